"""Our processors against transformers' own, on random logits."""

from __future__ import annotations

import pytest
import torch

from lmtrace.logits import measure, processors, sampling
from lmtrace.params import SamplingParams
from tests.oracle import hf_processors


def oracle(params: SamplingParams, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return hf_processors(params)(input_ids, logits.clone())


CASES = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=7),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.5, top_p=0.3),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.1, repetition_penalty=1.2),
    dict(temperature=2.0, repetition_penalty=0.8, top_k=1),
]


@pytest.mark.parametrize("kwargs", CASES, ids=[str(c) for c in CASES])
def test_processors_match_transformers(kwargs):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 200, generator=gen) * 3
    input_ids = torch.randint(0, 200, (3, 15), generator=gen)
    seen = torch.zeros(3, 200, dtype=torch.bool).scatter(1, input_ids, True)
    params = SamplingParams(**kwargs)
    ours = sampling.process_logits(logits, params, seen)
    theirs = oracle(params, input_ids, logits)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(theirs)
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-6)
    lp_ours = torch.log_softmax(ours, -1)
    lp_theirs = torch.log_softmax(theirs, -1)
    assert (lp_ours[finite] - lp_theirs[finite]).abs().max() < 1e-5


def test_filters_really_filter():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.isfinite(processors.apply_top_k(logits, 5)).sum() == 5
    assert torch.isfinite(processors.apply_top_p(logits, 0.5)).sum() < 100
    assert torch.isfinite(processors.apply_min_p(logits, 0.5)).sum() < 100
    # the most likely token always survives
    assert torch.isfinite(processors.apply_top_p(logits, 1e-9)).sum() == 1


def test_entropy_of_uniform_and_filtered():
    uniform = torch.log_softmax(torch.zeros(1, 8), -1)
    assert abs(measure.entropy(uniform).item() - torch.log(torch.tensor(8.0)).item()) < 1e-6
    filtered = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    assert abs(measure.entropy(torch.log_softmax(filtered, -1)).item() - torch.log(torch.tensor(2.0)).item()) < 1e-6


def test_choose_greedy_is_argmax_and_sampling_uses_the_generator():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sampling.choose(logits, SamplingParams(temperature=0), None), logits.argmax(-1))
    p = SamplingParams(temperature=1.0)
    a = sampling.choose(logits, p, torch.Generator().manual_seed(5))
    b = sampling.choose(logits, p, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    draws = {tuple(sampling.choose(logits, p, torch.Generator().manual_seed(s)).tolist()) for s in range(10)}
    assert len(draws) > 1
