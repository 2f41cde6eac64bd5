"""The server's scoring path: an echo request is one pass per prompt, `max_tokens` 0 and 1 run no
decode step, the prompts of a request are prefilled together, and echo requests share a prefix
cache whose numbers equal lone teacher forcing within the batched-versus-alone bound: also for
prompts that differ only in their last token or after a long shared beginning, after an
eviction, and after the weights changed."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.decode.tracing import generate_ids
from lmtrace.server import create_app

BOUND = 1e-5  # float32, batched and cached versus alone (measured below 3e-6 on the tiny model)


@contextlib.contextmanager
def forwards(model):
    """The (rows, new tokens) of every forward pass of `model` inside the block."""
    calls: list[tuple[int, int]] = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        yield calls
    finally:
        handle.remove()


def lone(lm, ids: list[int]) -> list[float]:
    """Lone teacher forcing: each token's logprob after the ones before it, one uncached forward."""
    with torch.inference_mode():
        lp = torch.log_softmax(lm.model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def score(client, prompts: list[list[int]], max_tokens: int = 1) -> dict:
    """lm-evaluation-harness's scoring request: token-id prompts, echo, one logprob, greedy."""
    body = {"prompt": prompts, "max_tokens": max_tokens, "logprobs": 1, "echo": True, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def worst(lm, prompts: list[list[int]], answer: dict) -> float:
    """The largest gap between the echoed prompt logprobs and lone teacher forcing."""
    gaps = []
    for ids, choice in zip(prompts, answer["choices"]):
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None
        gaps += [abs(a - b) for a, b in zip(got[1 : len(ids)], lone(lm, ids))]
    return max(gaps)


@pytest.fixture
def own_lm(tiny_tok):
    """A tiny model of this test's own (its weights change, or it counts its forwards)."""
    from lmtrace.model.lm import LM
    from tests.tiny import tiny_model

    return LM.from_objects(tiny_model(tiny_tok, seed=5), tiny_tok, source="tiny-own")


def questions(lm) -> list[list[int]]:
    """Four questions, each with three answers: twelve prompts, four beginnings."""
    tok = lm.tokenizer
    contexts = ["Once upon a time there was a little model that", "Hello world, the quick brown fox",
                "很久很久以前，有一个小模型。", "🙂 wörld, naïve café, größer. The lazy dog"]  # fmt: skip
    answers = [" counted tokens.", " jumps over", " the lazy dog"]
    return [tok(c)["input_ids"] + tok(a)["input_ids"] for c in contexts for a in answers]


def test_scoring_requests_equal_lone_teacher_forcing_and_reuse_their_beginnings(own_lm):
    prompts = questions(own_lm)
    with TestClient(create_app(own_lm, name="tiny")) as c:
        first = score(c, prompts[:6])
        second = score(c, prompts[6:])
        again = score(c, prompts)
        metrics = c.get("/metrics").text
    for answer, ps in ((first, prompts[:6]), (second, prompts[6:]), (again, prompts)):
        assert worst(own_lm, ps, answer) < BOUND
    # within a request the answers of one question waited for the first: its beginning was reused
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # asked again: every prompt from the cache, the same numbers to the bit
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(len(p) for p in prompts)
    for a, b in zip(first["choices"] + second["choices"], again["choices"]):
        assert a["logprobs"] == b["logprobs"] and a["text"] == b["text"]
    assert "lmtrace_prefix_cache_hit_tokens_total" in metrics and "lmtrace_prefix_cache_enabled 1" in metrics


def test_max_tokens_0_and_1_run_no_decode_step_and_one_forward(own_lm):
    prompts = questions(own_lm)[:4]
    with TestClient(create_app(own_lm, name="tiny", prefix_cache_bytes=0)) as c:
        for max_tokens in (0, 1):
            with forwards(own_lm.model) as calls:
                answer = score(c, prompts, max_tokens)
            assert calls == [(4, max(len(p) for p in prompts))]  # the four in one padded forward
            assert worst(own_lm, prompts, answer) < BOUND
            lengths = [len(ch["logprobs"]["tokens"]) for ch in answer["choices"]]
            assert lengths == [len(p) + max_tokens for p in prompts]


def test_echo_with_a_generation_is_one_pass_per_prompt(own_lm):
    ids = questions(own_lm)[0]
    with TestClient(create_app(own_lm, name="tiny")) as c, forwards(own_lm.model) as calls:
        body = {"prompt": ids, "max_tokens": 4, "logprobs": 2, "echo": True, "temperature": 0, "ignore_eos": True}
        answer = c.post("/v1/completions", json=body).json()
    assert calls == [(1, len(ids))] + [(1, 1)] * 3  # the prefill, then one token per step
    (trace,) = generate_ids(own_lm, [ids], max_new_tokens=4, temperature=0, stop_on_eos=False)
    got = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got[1 : len(ids)], lone(own_lm, ids))) < BOUND
    assert got[len(ids) :] == pytest.approx([s.logprob for s in trace.steps], abs=BOUND)


def test_cache_on_and_off_agree_within_the_bound(own_lm):
    prompts = questions(own_lm)
    answers = []
    for size in (1 << 26, 0):
        with TestClient(create_app(own_lm, name="tiny", prefix_cache_bytes=size)) as c:
            answers.append([score(c, prompts[i : i + 5]) for i in range(0, len(prompts), 5)])
    for on, off in zip(*answers):
        for a, b in zip(on["choices"], off["choices"]):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            pairs = zip(a["logprobs"]["token_logprobs"][1:], b["logprobs"]["token_logprobs"][1:])
            assert max(abs(x - y) for x, y in pairs) < BOUND
    assert all("prompt_tokens_details" not in a["usage"] for a in answers[1])


def test_last_token_and_long_prefix_never_borrow_numbers_even_after_eviction(own_lm):
    tok = own_lm.tokenizer
    long = tok(" ".join(["the quick brown fox jumps over the lazy dog"] * 5))["input_ids"]
    ends = [tok(e)["input_ids"] for e in (" Hello", " Once", " world", " 很")]
    prompts = [long + e for e in ends] + [long[:-1] + e[:1] for e in ends]  # after a long prefix; last token only
    with TestClient(create_app(own_lm, name="tiny")) as c:
        score(c, prompts[:1])
        limit = 3 * c.app.state.lmtrace.worker.lane.cache.bytes  # room for about three prompts
    with TestClient(create_app(own_lm, name="tiny", prefix_cache_bytes=limit)) as c:
        for p in prompts + prompts[::-1]:  # one by one: each finds the others' beginnings, some evicted
            assert worst(own_lm, [p], score(c, [p])) < BOUND
        stats = c.app.state.lmtrace.worker.lane.cache.stats
    assert stats.evictions > 0 and stats.hits > 0 and stats.peak_bytes <= limit


def test_changed_weights_are_never_served_stale_numbers(own_lm):
    prompts = questions(own_lm)[:3]
    with TestClient(create_app(own_lm, name="tiny")) as c:
        score(c, prompts)
        with torch.no_grad():
            own_lm.model.model.layers[1].self_attn.o_proj.weight.mul_(-1.0)  # in place, between requests
        answer = score(c, prompts)
        assert c.app.state.lmtrace.worker.lane.cache.stats.cleared == 1  # everything before was forgotten
        assert worst(own_lm, prompts, answer) < BOUND
    with TestClient(create_app(own_lm, name="tiny")) as c:  # a fresh server on the changed weights
        fresh = score(c, prompts)
    assert fresh["usage"] == answer["usage"]  # the same reuse: only within the request


def test_a_generation_is_computed_as_before_whatever_was_scored_before(chat_lm):
    ids = lmtrace.encode_prompt(chat_lm, "Once upon a time")
    plain = lmtrace.generate(chat_lm, "Once upon a time", max_new_tokens=5, temperature=0, top_logprobs=2)
    with TestClient(create_app(chat_lm, name="tiny")) as c:
        score(c, [ids, ids + [5]])  # the prompt and a longer one are in the cache now
        body = {"prompt": ids, "max_tokens": 5, "logprobs": 2, "temperature": 0}
        answer = c.post("/v1/completions", json=body).json()
        traced = c.post("/v1/traces", json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}).json()
    assert answer["choices"][0]["logprobs"]["token_logprobs"] == [s.logprob for s in plain.steps]  # to the bit
    assert "prompt_tokens_details" not in answer["usage"] and traced["timing"]["cached_tokens"] == 0
    assert [s["logprob"] for s in traced["steps"]] == [s.logprob for s in plain.steps]


def test_a_request_larger_than_the_cache_still_works(own_lm):
    prompts = [questions(own_lm)[i] for i in (0, 3)]  # two questions: nothing shared between them
    with TestClient(create_app(own_lm, name="tiny", prefix_cache_bytes=1000)) as c:
        for _ in range(2):
            answer = score(c, prompts)
            assert worst(own_lm, prompts, answer) < BOUND and "prompt_tokens_details" not in answer["usage"]
        cache = c.app.state.lmtrace.worker.lane.cache
    assert cache.bytes == 0 and cache.stats.skipped == 4


def test_a_one_token_generation_is_chosen_from_the_prefill(chat_lm):
    """max_tokens 1 without echo: no decode step, the same token and numbers as alone."""
    lm = dataclasses.replace(chat_lm, source="tiny-one")
    plain = lmtrace.generate(lm, "Hello world", max_new_tokens=1, temperature=0.8, seed=4, top_logprobs=3)
    with TestClient(create_app(lm, name="tiny")) as c:
        body = {"prompt": "Hello world", "max_tokens": 1, "top_logprobs": 3, "temperature": 0.8, "seed": 4}
        traced = c.post("/v1/traces", json=body).json()
    assert traced["steps"][0]["token_id"] == plain.steps[0].token_id
    assert traced["steps"][0]["logprob"] == plain.steps[0].logprob
    assert traced["steps"][0]["kv"] == plain.steps[0].kv and traced["finish_reason"] == "length"
