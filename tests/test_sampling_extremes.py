"""Sampling settings at the edge of float32, found by fuzzing the server: a temperature or a
repetition penalty so small that logits overflow still gives a distribution (no NaN)."""

from __future__ import annotations

import math

import pytest
import torch

import lmtrace
from lmtrace.logits.processors import apply_repetition_penalty, apply_temperature


@pytest.mark.parametrize("temperature", [1e-64, 1e-300, 5e-324])
def test_a_tiny_temperature_is_the_greedy_limit(temperature):
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0 - 1e-6]])
    out = torch.log_softmax(apply_temperature(logits, temperature), -1)
    assert out[0, 1] == 0 and not out.isnan().any()
    assert torch.equal(apply_temperature(logits, 0.5), logits / 0.5)  # ordinary values: untouched


def test_a_tiny_repetition_penalty_stays_finite():
    logits = torch.tensor([[1.0, -1.0, 0.5]])
    out = apply_repetition_penalty(logits, torch.tensor([[True, True, False]]), 1e-300)
    assert torch.isfinite(out).all()
    assert out[0, 0] == torch.finfo(torch.float32).max and out[0, 2] == 0.5


@pytest.mark.parametrize("fields", [{"temperature": 1e-64}, {"temperature": 0.7, "repetition_penalty": 1e-300}])
def test_generate_with_extreme_settings(tiny_lm, fields):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, seed=1, top_logprobs=2, **fields)
    assert len(trace.steps) == 4
    assert all(s.sampled_logprob is None or not math.isnan(s.sampled_logprob) for s in trace.steps)
