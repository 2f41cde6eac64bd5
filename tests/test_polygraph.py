"""The estimators that need another pass (PMI, conditional PMI, p(True)) against a hand
computation from transformers' logits within 1e-6; and, where lm-polygraph installs beside
lmtrace, its own estimator classes on the same numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import lmtrace
from lmtrace.logits import sequence
from lmtrace.scoring.uncertainty import polygraph
from tests import uncertainty_oracle as oracle

TOL = 1e-6


@pytest.fixture(scope="module")
def traced(tiny_lm):
    return lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=10, temperature=0.9, seed=2, uncertainty=True)


def _by_hand(lm, trace):
    ids = list(trace.token_ids)
    with torch.no_grad():
        lm_lp = torch.log_softmax(lm.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    uncond = [0.0] + [float(lm_lp[t - 1, ids[t]]) for t in range(1, len(ids))]
    logits = oracle.step_logits(lm.model, trace.prompt["token_ids"], ids)
    raw = torch.log_softmax(logits, dim=-1)
    lps = [float(raw[i, t]) for i, t in enumerate(ids)]
    ents = [oracle.token_scores(raw[i], t, 1)["entropy"] for i, t in enumerate(ids)]
    return lps, uncond, ents


def test_pmi_and_cpmi_equal_the_hand_computation(tiny_lm, traced):
    got = polygraph.pmi(tiny_lm, traced)
    lps, uncond, ents = _by_hand(tiny_lm, traced)
    pmi = [lp - (u if t > 0 else 0) for t, (lp, u) in enumerate(zip(lps, uncond))]
    cpmi = [lp - 3.599 * u if t > 0 and h >= 0.0656 else lp for t, (lp, u, h) in enumerate(zip(lps, uncond, ents))]
    assert got["pmi"] == pytest.approx(-sum(pmi) / len(pmi), abs=TOL)
    assert got["cpmi"] == pytest.approx(-sum(cpmi) / len(cpmi), abs=TOL)
    assert got["unconditioned"][1:] == pytest.approx(uncond[1:], abs=TOL)


def test_p_true_is_one_forward_of_the_prompt(tiny_lm, traced):
    got = polygraph.p_true(tiny_lm, "Hello world", traced.text)
    tok = tiny_lm.tokenizer
    prompt = polygraph.P_TRUE_PROMPT.format(question="Hello world", answer=traced.text.strip())
    p_ids = tok(prompt)["input_ids"]
    c_ids = tok(prompt + polygraph.P_TRUE_CONTINUATION)["input_ids"][len(p_ids) :]
    with torch.no_grad():
        lp = torch.log_softmax(tiny_lm.model(input_ids=torch.tensor([p_ids + c_ids])).logits[0].float(), dim=-1)
    want = sum(float(lp[len(p_ids) + j - 1, c]) for j, c in enumerate(c_ids))
    assert got["p_true"] == pytest.approx(want, abs=1e-5) and got["PTrue"] == -got["p_true"]
    assert got["prob"] == pytest.approx(math.exp(want), rel=1e-5)


def test_lm_polygraph_estimators_agree(traced):
    estimators = pytest.importorskip(
        "lm_polygraph.estimators",
        reason="lm-polygraph does not install beside lmtrace: its requirements pin transformers>=4.50,<4.58 "
        "(lmtrace runs on transformers 5.x), and `pip install --dry-run lm-polygraph` here builds pytreebank "
        "from source and did not finish in 150 s",
    )
    lps = np.array([s.logprob for s in traced.steps])
    ents = np.array([s.entropy for s in traced.steps])
    stats = {"greedy_log_likelihoods": [lps], "entropy": [ents]}
    u = traced.uncertainty
    assert estimators.MaximumSequenceProbability()(stats)[0] == pytest.approx(u["msp"], abs=TOL)
    assert estimators.Perplexity()(stats)[0] == pytest.approx(u["mean_nll"], abs=TOL)
    assert estimators.MeanTokenEntropy()(stats)[0] == pytest.approx(u["mean_entropy"], abs=TOL)


def test_sequence_math_edge_cases():
    assert sequence.deepconf([], 4, 4)["mean"] is None
    assert sequence.groups([1.0, 2.0, 3.0], 2) == [1.5, 2.5]
    assert sequence.deepconf([1.0, 5.0, 3.0, 4.0], 2, 1) | {"groups": None} == {
        "mean": 3.25, "bottom10": 3.0, "lowest_group": 3.0, "tail": 4.0, "groups": None}  # fmt: skip
