"""Determinism: the same seed gives the same tokens across runs (whatever the global RNGs
hold), greedy decoding gives the same tokens at every batch size, and streaming gives what
the whole answer gives. Batching changes logprobs only by float rounding: measured here (the
bound is in docs/tracing.md, "Determinism")."""

from __future__ import annotations

import math
import random

import pytest
import torch
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.records import Trace
from lmtrace.server import create_app
from tests.server.conftest import sse_events

PROMPTS = [
    "Hello world",
    "很久很久以前，",
    "🙂 wörld, the quick brown fox",
    "a",
    "Once upon a time there was",
    "lazy dog",
    "größer café",
    "Hi",
]
TINY_BOUND = 1e-4  # measured about 1e-5 (float32)
BUNDLED_BOUND = 5e-4  # measured about 4e-5 (float32)


def worst_difference(a: Trace, b: Trace) -> float:
    """The largest difference between two traces' numbers: each step's raw logprob, entropy
    and the alternatives' logprobs (the tokens are compared separately)."""
    worst = 0.0
    for s, t in zip(a.steps, b.steps, strict=True):
        pairs = [(s.logprob, t.logprob), (s.entropy, t.entropy)]
        pairs += [(x.logprob, y.logprob) for x, y in zip(s.top, t.top, strict=True)]
        worst = max([worst, *(abs(x - y) for x, y in pairs if math.isfinite(x))])
    return worst


def test_the_same_seed_gives_the_same_tokens_across_runs(tiny_lm):
    kwargs = dict(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=1234, top_logprobs=3)
    first = lmtrace.generate(tiny_lm, "Once upon a time", **kwargs)
    torch.manual_seed(999)  # the global generators must not matter
    random.seed(5)
    lmtrace.generate(tiny_lm, "Hello", max_new_tokens=5, temperature=1.3, seed=7)  # nor other work between
    again = lmtrace.generate(tiny_lm, "Once upon a time", **kwargs)
    assert again.token_ids == first.token_ids and worst_difference(first, again) == 0.0
    batch = lmtrace.generate(tiny_lm, PROMPTS[:3], **kwargs)  # a seeded batch too
    assert [t.token_ids for t in lmtrace.generate(tiny_lm, PROMPTS[:3], **kwargs)] == [t.token_ids for t in batch]


def test_greedy_tokens_are_the_same_at_every_batch_size(tiny_lm):
    kwargs = dict(max_new_tokens=16, temperature=0, top_logprobs=5, stop_on_eos=False)
    alone = [lmtrace.generate(tiny_lm, p, **kwargs) for p in PROMPTS]
    worst = {}
    for size in (2, 4, 8):
        worst[size] = 0.0
        for k in range(0, len(PROMPTS), size):  # prompts of different lengths: left padding
            for batched, single in zip(lmtrace.generate(tiny_lm, PROMPTS[k : k + size], **kwargs), alone[k:]):
                assert batched.token_ids == single.token_ids
                worst[size] = max(worst[size], worst_difference(batched, single))
    same = lmtrace.generate(tiny_lm, [PROMPTS[0]] * 4, **kwargs)  # one prompt four times
    assert all(t.token_ids == alone[0].token_ids for t in same)
    worst["4 x same"] = max(worst_difference(t, alone[0]) for t in same)
    assert max(worst.values()) < TINY_BOUND, worst
    print(f"\ntiny model, batched vs alone, largest logprob difference: {worst}")


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}])
def test_streaming_gives_what_the_whole_answer_gives(tiny_lm, kwargs):
    kwargs = {**kwargs, "max_new_tokens": 12, "top_logprobs": 3}
    whole = lmtrace.generate(tiny_lm, "Once upon a time", **kwargs)
    streamed = list(lmtrace.stream(tiny_lm, "Once upon a time", **kwargs))
    assert [s.token_id for s in streamed] == whole.token_ids
    assert [(s.logprob, s.sampled_logprob, s.text) for s in streamed] == [
        (s.logprob, s.sampled_logprob, s.text) for s in whole.steps
    ]


def streamed_choices(text: str, n: int) -> list[tuple[str, list]]:
    """Each choice's text and token logprobs, put together from a completions stream."""
    out = [("", []) for _ in range(n)]
    for event in sse_events(text):
        for c in event["choices"]:
            joined, lps = out[c["index"]]
            out[c["index"]] = (joined + c["text"], lps + (c["logprobs"]["token_logprobs"] if c["logprobs"] else []))
    return out


def test_the_server_streamed_or_not_and_at_any_n(tiny_lm):
    body = {"prompt": "Hello world", "max_tokens": 10, "logprobs": 2, "ignore_eos": True}
    with TestClient(create_app(tiny_lm, name="tiny")) as c:
        for fields in ({"temperature": 0, "n": 1}, {"temperature": 0.8, "seed": 5, "n": 3}):
            whole = c.post("/v1/completions", json={**body, **fields}).json()["choices"]
            again = c.post("/v1/completions", json={**body, **fields}).json()["choices"]
            assert again == whole
            stream = c.post("/v1/completions", json={**body, **fields, "stream": True}).text
            assert streamed_choices(stream, fields["n"]) == [
                (w["text"], w["logprobs"]["token_logprobs"]) for w in whole
            ]
        # greedy: four choices decode as a batch of four, each the same as one alone
        one = c.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]
        four = c.post("/v1/completions", json={**body, "temperature": 0, "n": 4}).json()["choices"]
        for choice in four:
            assert choice["logprobs"]["tokens"] == one["logprobs"]["tokens"]
            lps = zip(choice["logprobs"]["token_logprobs"], one["logprobs"]["token_logprobs"], strict=True)
            assert max(abs(a - b) for a, b in lps) < TINY_BOUND


@pytest.mark.integration
def test_bundled_greedy_batch_equals_alone_within_the_bound(bundled_lm):
    prompts = ["The capital of France is", "很久很久以前，", "def fibonacci(n):", "Once upon a time there was a"]
    kwargs = dict(max_new_tokens=6, temperature=0, top_logprobs=5)
    batch = lmtrace.generate(bundled_lm, prompts, **kwargs)
    worst = 0.0
    for prompt, batched in zip(prompts, batch, strict=True):
        alone = lmtrace.generate(bundled_lm, prompt, **kwargs)
        assert batched.token_ids == alone.token_ids
        worst = max(worst, worst_difference(batched, alone))
    assert worst < BUNDLED_BOUND
    print(f"\nbundled model, batch of 4 vs alone, largest logprob difference: {worst:.2e}")


# rows of one continuous batch, each with its own settings and length (lmtrace.decode.continuous)
MIXED = [
    {"temperature": 0, "max_new_tokens": 8, "top_logprobs": 5},
    {"temperature": 0.8, "top_k": 40, "seed": 1, "max_new_tokens": 3, "top_logprobs": 5},
    {"temperature": 0.9, "min_p": 0.05, "repetition_penalty": 1.2, "seed": 2, "max_new_tokens": 6, "top_logprobs": 5},
    {"temperature": 0, "repetition_penalty": 1.3, "max_new_tokens": 5, "top_logprobs": 5},
    {"temperature": 1.1, "top_p": 0.9, "seed": 3, "max_new_tokens": 7, "top_logprobs": 5},
]


def mixed_rows_vs_alone(lm, prompts: list[str], max_batch: int) -> float:
    """Decodes the prompts with MIXED settings, `max_batch` rows at a time (so rows join while
    others are mid-flight); asserts each row's tokens are its alone tokens; the worst difference."""
    from lmtrace.decode.continuous import RowSpec, generate_rows

    params = [lmtrace.SamplingParams(**kw) for kw in MIXED]
    specs = [RowSpec(lmtrace.encode_prompt(lm, p), sp, p) for p, sp in zip(prompts, params)]
    worst = 0.0
    for prompt, sp, together in zip(prompts, params, generate_rows(lm, specs, max_batch=max_batch), strict=True):
        alone = lmtrace.generate(lm, prompt, sp)
        assert together.token_ids == alone.token_ids, prompt
        assert [s.kv for s in together.steps] == [s.kv for s in alone.steps]
        worst = max(worst, worst_difference(together, alone))
    return worst


@pytest.mark.parametrize("max_batch", [5, 2])
def test_mixed_settings_and_rows_joining_mid_flight_decode_as_alone(tiny_lm, max_batch):
    assert mixed_rows_vs_alone(tiny_lm, PROMPTS[:5], max_batch) < TINY_BOUND


@pytest.mark.integration
def test_bundled_mixed_settings_joining_mid_flight_within_the_bound(bundled_lm):
    prompts = ["The capital of France is", "很久很久以前，", "def fibonacci(n):", "Once upon a time there was a", "Hi"]
    worst = mixed_rows_vs_alone(bundled_lm, prompts, max_batch=3)
    assert worst < 5e-5  # the batched-versus-alone bound the server documents for the bundled model
    print(f"\nbundled model, mixed settings joining mid-flight vs alone, largest logprob difference: {worst:.2e}")
