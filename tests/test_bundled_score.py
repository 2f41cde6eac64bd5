"""Integration: scoring, echo, rescore and branching on the bundled SmolLM2-135M-Instruct.

Tolerances, float32 on CPU: a score equals a plain forward pass over the same window within
1e-5 (the same computation); against a forward over a different length (an exact prefix, or
cached decoding) float32 matmuls round differently, up to ~2e-5 measured, so 1e-4 there."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from tests.oracle import hf_greedy
from tests.test_echo import forward_calls

pytestmark = pytest.mark.integration

TEXT = "The capital of France is Paris. 很久很久以前，有一个小村庄。 Emoji 🙂 and naïve café."


def log_probs(lm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)


def test_score_equals_a_forward_pass(bundled_lm):
    r = lmtrace.score(bundled_lm, TEXT)
    ids = bundled_lm.tokenizer(TEXT)["input_ids"]
    lp = log_probs(bundled_lm, ids)
    assert r.token_ids == ids and r.tokens[0].logprob is None
    assert max(abs(t.logprob - lp[i - 1, ids[i]].item()) for i, t in enumerate(r.tokens) if i) < 1e-5
    assert [t.rank for t in r.tokens[1:]] == [
        int((lp[i - 1] > lp[i - 1, ids[i]]).sum()) + 1 for i in range(1, len(ids))
    ]
    assert "".join(t.text for t in r.tokens) == bundled_lm.tokenizer.decode(ids) == TEXT


def test_continuation_and_sliding_window(bundled_lm):
    r = lmtrace.score(bundled_lm, prompt="The capital of France is", continuation=" Paris.")
    head = bundled_lm.tokenizer("The capital of France is")["input_ids"]
    lp = log_probs(bundled_lm, head + r.token_ids)
    assert max(abs(t.logprob - lp[len(head) + i - 1, t.token_id].item()) for i, t in enumerate(r.tokens)) < 1e-5
    assert r.tokens[0].rank == 1  # the model knows
    ids = bundled_lm.tokenizer(TEXT)["input_ids"]
    w, s = 16, 6
    windowed = lmtrace.score(bundled_lm, TEXT, window=w, stride=s)
    worst_window = worst_prefix = 0.0
    windows = {}  # begin -> the forward over that window: one per window, not one per token
    for t in range(1, len(ids)):
        begin = 0 if t < w else ((t - w) // s + 1) * s
        if begin not in windows:
            windows[begin] = log_probs(bundled_lm, ids[begin : begin + w])
        same = windows[begin][t - begin - 1, ids[t]].item()
        prefix = log_probs(bundled_lm, ids[begin : t + 1])[-2, ids[t]].item()
        worst_window = max(worst_window, abs(windowed.tokens[t].logprob - same))
        worst_prefix = max(worst_prefix, abs(windowed.tokens[t].logprob - prefix))
    assert worst_window < 1e-5 and worst_prefix < 1e-4


def test_batch_equals_alone(bundled_lm):
    items = [TEXT, ("The capital of France is", " Paris."), "Hello"]
    batch = lmtrace.score_batch(bundled_lm, items)
    alone = [lmtrace.score(bundled_lm, TEXT), lmtrace.score(bundled_lm, prompt=items[1][0], continuation=items[1][1])]
    alone.append(lmtrace.score(bundled_lm, "Hello"))
    for b, a in zip(batch, alone):
        assert b.token_ids == a.token_ids
        assert (
            max((abs(x.logprob - y.logprob) for x, y in zip(b.tokens, a.tokens) if x.logprob is not None), default=0)
            < 1e-4
        )


def test_echo_and_rescore(bundled_lm):
    trace = lmtrace.generate(bundled_lm, "The capital of France is", max_new_tokens=10, temperature=0, echo=True)
    ids = trace.prompt["token_ids"]
    lp = log_probs(bundled_lm, ids)
    assert max(abs(t.logprob - lp[i - 1, ids[i]].item()) for i, t in enumerate(trace.prompt_logprobs) if i) < 1e-5
    r = lmtrace.rescore(bundled_lm, trace)
    assert r["max_abs_diff"] < 1e-4 and r["max_abs_diff_prompt"] < 1e-5 and r["rank_mismatches"] == 0


def test_branch_reuses_the_prefix_and_continues_greedily(bundled_lm):
    n, at = 10, 2
    with forward_calls(bundled_lm.model) as calls:
        result = lmtrace.branch(bundled_lm, "The capital of France is", at, [2], max_new_tokens=n, temperature=0)
    original, b = result.traces
    ids = original.prompt["token_ids"]
    assert calls == [len(ids)] + [1] * (len(original.steps) - 1) + [1] * (len(b.steps) - at - 1)
    assert b.token_ids[:at] == original.token_ids[:at] and b.steps[at].rank == 2
    hf_ids, _ = hf_greedy(bundled_lm, ids + b.token_ids[: at + 1], n - at - 1)
    assert b.token_ids[at + 1 :] == hf_ids
    assert lmtrace.rescore(bundled_lm, b)["max_abs_diff"] < 1e-4
