"""generate(echo=True): the prompt's own logprobs from the prefill pass, and rescore()."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

import lmtrace
from lmtrace import InvalidParameter, Trace


@contextlib.contextmanager
def forward_calls(model):
    """The input length of every forward call of `model` made inside the block."""
    calls: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        yield calls
    finally:
        handle.remove()


def prompt_oracle(lm, ids: list[int]) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


PROMPT = "很久很久以前，the quick brown fox 🙂"


def test_echo_matches_a_forward_pass_and_costs_no_second_pass(tiny_lm):
    with forward_calls(tiny_lm.model) as calls:
        trace = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=6, temperature=0, echo=True, top_logprobs=3)
    ids = trace.prompt["token_ids"]
    assert calls == [len(ids)] + [1] * (len(trace.steps) - 1)  # prefill, then one token per step
    tokens = trace.prompt_logprobs
    assert [t.token_id for t in tokens] == ids
    assert tokens[0].logprob is None and tokens[0].rank is None and tokens[0].top == []
    expected = prompt_oracle(tiny_lm, ids)
    assert max(abs(t.logprob - e) for t, e in zip(tokens[1:], expected)) < 1e-5
    assert all(len(t.top) == 3 for t in tokens[1:])
    assert "".join(t.text for t in tokens) == tiny_lm.tokenizer.decode(ids)
    plain = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=6, temperature=0)
    assert plain.prompt_logprobs is None and plain.token_ids == trace.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(plain.steps, trace.steps)) < 1e-5


def test_echo_in_a_left_padded_batch(tiny_lm):
    prompts = ["Hi", PROMPT, "Once upon a time"]
    traces = lmtrace.generate(tiny_lm, prompts, max_new_tokens=3, temperature=0, echo=True)
    for trace in traces:
        ids = trace.prompt["token_ids"]
        assert len(trace.prompt_logprobs) == len(ids)
        got = [t.logprob for t in trace.prompt_logprobs[1:]]
        assert max((abs(a - b) for a, b in zip(got, prompt_oracle(tiny_lm, ids))), default=0.0) < 1e-5


def test_echo_json_round_trip_and_old_json_still_loads(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=3, temperature=0.8, seed=1, echo=True)
    d = json.loads(trace.to_json())
    assert d["prompt_logprobs"][0]["logprob"] is None and d["prompt_logprobs"][1]["logprob"] < 0
    assert Trace.from_json(trace.to_json()) == trace
    plain = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=3, temperature=0)
    old = json.loads(plain.to_json())
    assert "prompt_logprobs" not in old and "waterfall" not in old["steps"][0]  # absent unless asked for
    assert Trace.from_dict(old) == plain


def test_rescore_of_cached_decoding(tiny_lm):
    kwargs = dict(temperature=0.7, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    trace = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=16, seed=3, echo=True, **kwargs)
    r = lmtrace.rescore(tiny_lm, Trace.from_json(trace.to_json()))
    assert r["steps"] == len(trace.steps) == len(r["logprobs"])
    assert r["max_abs_diff"] < 1e-5 and r["max_abs_diff_sampled"] < 1e-5
    assert r["max_abs_diff_prompt"] < 1e-5 and r["rank_mismatches"] == 0
    greedy = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=12, temperature=0)
    assert lmtrace.rescore(tiny_lm, greedy)["max_abs_diff"] < 1e-5


def test_rescore_finds_a_wrong_number(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=8, temperature=0)
    trace.steps[5].logprob -= 0.25
    r = lmtrace.rescore(tiny_lm, trace)
    assert r["worst_step"] == 5 and r["max_abs_diff"] == pytest.approx(0.25, abs=1e-5)


def test_rescore_needs_steps(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=2, temperature=0)
    trace.steps = []
    with pytest.raises(InvalidParameter, match="trace must hold a prompt and at least one step, got 0 steps"):
        lmtrace.rescore(tiny_lm, trace)
