"""The explicit loop against transformers on the tiny model (fast, offline)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import lmtrace
from lmtrace import InvalidParameter
from tests.oracle import hf_greedy, hf_processors, teacher_forced

PROMPTS = ["Hello world", "很久很久以前，", "🙂 wörld, the quick brown fox"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_generate_ids_and_logprobs(tiny_lm, prompt):
    ids = lmtrace.encode_prompt(tiny_lm, prompt)
    trace = lmtrace.generate(tiny_lm, prompt, max_new_tokens=24, temperature=0, top_logprobs=5)
    hf_ids, hf_logits = hf_greedy(tiny_lm, ids, 24)
    assert trace.token_ids == hf_ids
    hf_lp = torch.log_softmax(hf_logits, -1)
    worst = max(abs(s.logprob - hf_lp[i, s.token_id].item()) for i, s in enumerate(trace.steps))
    assert worst < 1e-5
    for i, s in enumerate(trace.steps):
        top = torch.topk(hf_lp[i], 5)
        assert [a.token_id for a in s.top] == top.indices.tolist()
        assert s.rank == int((hf_lp[i] > hf_lp[i, s.token_id]).sum()) + 1 == 1
        # greedy without penalty: the sampled distribution is the raw one
        assert s.sampled_logprob == pytest.approx(s.logprob, abs=1e-6)


def test_greedy_with_repetition_penalty_matches_generate(tiny_lm):
    ids = lmtrace.encode_prompt(tiny_lm, "the quick brown fox")
    trace = lmtrace.generate(tiny_lm, "the quick brown fox", max_new_tokens=24, temperature=0, repetition_penalty=1.5)
    hf_ids, hf_logits = hf_greedy(tiny_lm, ids, 24, repetition_penalty=1.5)
    assert trace.token_ids == hf_ids
    procs = hf_processors(lmtrace.SamplingParams(temperature=0, repetition_penalty=1.5))
    seq = torch.tensor([ids + hf_ids])
    for i, s in enumerate(trace.steps):
        processed = procs(seq[:, : len(ids) + i], hf_logits[i : i + 1].clone())
        assert abs(s.sampled_logprob - torch.log_softmax(processed, -1)[0, s.token_id].item()) < 1e-5


SAMPLED = [
    dict(temperature=0.8),
    dict(temperature=1.2, top_k=10),
    dict(temperature=0.9, top_p=0.7),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.7, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
]


@pytest.mark.parametrize("kwargs", SAMPLED, ids=[str(k) for k in SAMPLED])
def test_sampled_logprobs_match_transformers_processors(tiny_lm, kwargs):
    trace = lmtrace.generate(tiny_lm, "Once upon a time", max_new_tokens=16, seed=7, top_logprobs=3, **kwargs)
    params = lmtrace.SamplingParams(**kwargs)
    raw, used = teacher_forced(tiny_lm, trace.prompt["token_ids"], trace.token_ids, params)
    for s, r, u in zip(trace.steps, raw, used):
        assert abs(s.logprob - r) < 1e-5
        assert math.isfinite(s.sampled_logprob)  # a sampled token was never filtered
        assert abs(s.sampled_logprob - u) < 1e-5
        for a in s.top:
            assert a.sampled_logprob <= 0 or math.isinf(a.sampled_logprob)


def test_filtered_alternatives_are_minus_infinity_and_null_in_json(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=1.0, top_k=1, seed=1, top_logprobs=5)
    for s in trace.steps:
        assert s.rank == 1 and s.sampled_logprob == 0.0 and s.sampled_entropy == 0.0
        assert [math.isinf(a.sampled_logprob) for a in s.top] == [False, True, True, True, True]
    d = trace.to_dict()
    assert d["steps"][0]["top"][1]["sampled_logprob"] is None
    assert lmtrace.Trace.from_json(trace.to_json()).steps[0].top[1].sampled_logprob == float("-inf")


def test_same_seed_same_tokens_and_other_seed_differs(tiny_lm):
    run = lambda seed: lmtrace.generate(tiny_lm, "Hello", max_new_tokens=20, temperature=1.5, seed=seed).token_ids  # noqa: E731
    assert run(3) == run(3)
    assert any(run(s) != run(3) for s in (4, 5, 6))


def test_seed_is_recorded_when_not_given(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=5, temperature=1.0)
    seed = trace.params["seed"]
    assert isinstance(seed, int)
    again = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=5, temperature=1.0, seed=seed)
    assert again.token_ids == trace.token_ids


def test_batch_of_different_lengths_gives_the_same_tokens_as_alone(tiny_lm):
    traces = lmtrace.generate(tiny_lm, PROMPTS, max_new_tokens=16, temperature=0)
    assert len(traces) == 3
    for prompt, batched in zip(PROMPTS, traces):
        alone = lmtrace.generate(tiny_lm, prompt, max_new_tokens=16, temperature=0)
        assert batched.token_ids == alone.token_ids
        assert batched.text == alone.text
        worst = max(abs(a.logprob - b.logprob) for a, b in zip(batched.steps, alone.steps))
        assert worst < 1e-4


def test_text_pieces_join_to_decode_with_split_characters(tiny_lm):
    for prompt in PROMPTS:
        trace = lmtrace.generate(tiny_lm, prompt, max_new_tokens=40, temperature=1.0, seed=11, stop_on_eos=False)
        joined = "".join(s.text for s in trace.steps)
        assert joined == tiny_lm.tokenizer.decode(trace.token_ids)
        assert all(bytes(s.bytes) for s in trace.steps)


def test_kv_state_grows_one_position_per_step(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=6, temperature=0)
    n = len(trace.prompt["token_ids"])
    cfg = tiny_lm.model.config
    per_position = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    for i, s in enumerate(trace.steps):
        assert s.kv["seq_len"] == n + i
        assert s.kv["bytes"] == per_position * (n + i)


def test_stops_at_eos_and_reports_it(tiny_lm):
    free = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=12, temperature=0, stop_on_eos=False)
    eos = free.token_ids[4]
    first = free.token_ids.index(eos)
    lm = dataclasses.replace(tiny_lm, eos_token_ids=[eos])  # the same model, another end token
    trace = lmtrace.generate(lm, "Hello", max_new_tokens=12, temperature=0)
    assert trace.token_ids == free.token_ids[: first + 1]
    assert trace.finish_reason == "stop" and trace.stop_reason == eos
    assert trace.text == tiny_lm.tokenizer.decode(free.token_ids[:first])
    assert "".join(s.text for s in trace.steps) == tiny_lm.tokenizer.decode(trace.token_ids)


def test_stop_string_cuts_the_text(tiny_lm):
    free = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=30, temperature=0, stop_on_eos=False)
    assert free.finish_reason == "length" and len(free.steps) == 30
    stop = free.text[10:13]
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=30, temperature=0, stop=[stop], stop_on_eos=False)
    assert trace.finish_reason == "stop" and trace.stop_reason == stop
    assert trace.text == free.text[: free.text.find(stop)]
    assert len(trace.steps) < 30


def test_prompt_too_long_for_context_is_rejected(tiny_lm):
    with pytest.raises(InvalidParameter, match="max_new_tokens must fit the context"):
        lmtrace.generate(tiny_lm, "Hello", max_new_tokens=256, temperature=0)


def test_stream_yields_the_same_steps_as_generate(tiny_lm):
    streamed = list(lmtrace.stream(tiny_lm, "Hello world", max_new_tokens=8, temperature=0))
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=8, temperature=0)
    assert [s.token_id for s in streamed] == trace.token_ids
    assert [s.text for s in streamed] == [s.text for s in trace.steps]
    assert all(s.time_ms > 0 for s in streamed)


def test_generate_steps_gives_numbers_only(tiny_lm):
    ids = [lmtrace.encode_prompt(tiny_lm, "Hello"), lmtrace.encode_prompt(tiny_lm, "Once upon a time")]
    steps = list(lmtrace.generate_steps(tiny_lm, ids, max_new_tokens=5, temperature=0, top_logprobs=2))
    assert len(steps) == 5
    assert all(len(s.token_ids) == 2 and len(s.top_ids[0]) == 2 for s in steps)


def test_compiled_static_cache_gives_the_same_tokens(tiny_lm):
    """--compile: a StaticCache and a torch.compile'd decode step (a one-off compile here)."""
    prompts = ["Hello world", "Once upon a time there was"]
    plain = lmtrace.generate(tiny_lm, prompts, max_new_tokens=6, temperature=0, stop_on_eos=False)
    compiled = lmtrace.generate(tiny_lm, prompts, max_new_tokens=6, temperature=0, stop_on_eos=False, compile=True)
    for a, b in zip(plain, compiled):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.steps, b.steps)) < 1e-5
        assert b.params["compile"] is True and b.kv_anatomy["mismatches"] == []
        last = b.steps[-1].kv
        assert last["bytes"] > last["bytes_used"] == a.steps[-1].kv["bytes"]  # preallocated, fewer in use
