"""The sampling waterfall: each stage against transformers' own processors, one at a time."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import lmtrace
from lmtrace import InvalidParameter

SETTINGS = dict(temperature=0.7, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3)


def hf_stages(lm, trace, index: int, kw: dict) -> list[torch.Tensor]:
    """Logits (1, vocab) after each stage at step `index`, by transformers' processors on an
    independent uncached forward pass."""
    seq = torch.tensor([trace.prompt["token_ids"] + trace.token_ids[:index]])
    with torch.no_grad():
        raw = lm.model(seq).logits[:, -1, :].float()
    procs = [
        RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]),
        TemperatureLogitsWarper(kw["temperature"]),
        TopKLogitsWarper(kw["top_k"]),
        TopPLogitsWarper(kw["top_p"]),
        MinPLogitsWarper(kw["min_p"]),
    ]
    out = [raw]
    for proc in procs:
        out.append(proc(seq, out[-1].clone()))
    return out


def test_every_stage_matches_transformers_processors(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Once upon a time", max_new_tokens=10, seed=4, waterfall="all", **SETTINGS)
    assert all(s.waterfall is not None for s in trace.steps)
    for step in trace.steps:
        stages = step.waterfall
        assert [s["stage"] for s in stages] == ["raw", "repetition_penalty", "temperature", "top_k", "top_p", "min_p"]
        follow = [t["token_id"] for t in stages[0]["tokens"]]
        assert follow == [a.token_id for a in step.top]  # the raw top tokens, in raw order
        previous = None
        for stage, logits in zip(stages, hf_stages(tiny_lm, trace, step.index, SETTINGS)):
            probs = torch.softmax(logits, -1)[0]
            allowed = torch.isfinite(logits[0])
            assert stage["allowed"] == int(allowed.sum())
            assert [t["token_id"] for t in stage["tokens"]] == follow
            assert [t["prob"] for t in stage["tokens"]] == pytest.approx(probs[follow].tolist(), abs=1e-5)
            assert stage["chosen_prob"] == pytest.approx(probs[step.token_id].item(), abs=1e-5)
            assert stage["entropy"] == pytest.approx(-(probs[allowed] * probs[allowed].log()).sum().item(), abs=1e-4)
            removed = 0.0 if previous is None else previous[allowed.logical_not()].sum().item()
            assert stage["removed_mass"] == pytest.approx(removed, abs=1e-5)
            previous = probs
        # the first stage is the raw distribution, the last the one the token was drawn from
        assert stages[0]["chosen_prob"] == pytest.approx(math.exp(step.logprob), abs=1e-6)
        assert stages[0]["chosen_rank"] == step.rank
        assert stages[-1]["chosen_prob"] == pytest.approx(math.exp(step.sampled_logprob), abs=1e-6)


def test_stage_counts_follow_the_settings(tiny_lm):
    kw = dict(temperature=1.0, top_k=12, top_p=0.6, min_p=0.1)
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=12, seed=1, waterfall="all", **kw)
    for step in trace.steps:
        by = {s["stage"]: s for s in step.waterfall}
        assert by["top_k"]["allowed"] <= 12
        # top-p leaves the smallest set of the top-k survivors whose mass reaches p
        seq = torch.tensor([trace.prompt["token_ids"] + trace.token_ids[: step.index]])
        with torch.no_grad():
            logits = tiny_lm.model(seq).logits[0, -1].float()
        q = torch.softmax(TopKLogitsWarper(12)(seq, logits[None].clone()), -1)[0].sort(descending=True).values
        kept = by["top_p"]["allowed"]
        assert q[:kept].sum() >= 0.6 - 1e-6 and q[: kept - 1].sum() < 0.6 + 1e-6
        assert by["min_p"]["allowed"] <= kept
        assert by["min_p"]["allowed"] == int((q[:kept] >= 0.1 * q[0]).sum())  # ratios survive renormalizing


def test_top_p_can_remove_the_raw_runner_up(tiny_lm):
    trace = lmtrace.generate(
        tiny_lm, "Once upon", max_new_tokens=16, temperature=1.0, top_p=0.3, seed=0, waterfall="all"
    )
    shown = [s for s in trace.steps if s.waterfall[4]["tokens"][1]["prob"] == 0.0 < s.waterfall[3]["tokens"][1]["prob"]]
    assert shown, "no step where top-p removed the raw model's second choice"
    assert shown[0].waterfall[4]["stage"] == "top_p" and shown[0].waterfall[4]["removed_mass"] > 0


def test_one_step_and_greedy(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=5, temperature=0, repetition_penalty=1.5, waterfall=2)
    assert [s.waterfall is not None for s in trace.steps] == [False, False, True, False, False]
    stages = trace.steps[2].waterfall
    assert [s["applied"] for s in stages] == [True, True, False, False, False, False]
    assert stages[-1]["chosen_prob"] == pytest.approx(math.exp(trace.steps[2].sampled_logprob), abs=1e-6)
    assert stages[1]["chosen_rank"] == 1  # greedy takes the argmax of the penalized distribution
    assert lmtrace.Trace.from_json(trace.to_json()) == trace
    tokens = stages[0]["tokens"]
    assert len(tokens) == 5  # top_logprobs 5
    assert [t["text"] for t in tokens] == [a.text for a in trace.steps[2].top]


@pytest.mark.parametrize("value", [-1, 5, "x", 1.5, True])
def test_bad_step(tiny_lm, value):
    with pytest.raises(InvalidParameter, match=r"waterfall must be a step index in \[0, 4\] or 'all', got"):
        lmtrace.generate(tiny_lm, "Hello", max_new_tokens=5, waterfall=value)
