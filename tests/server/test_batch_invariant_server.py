"""The batch-invariant server: a request's numbers are the same bits alone and among concurrent
requests arriving staggered (joining the running batch at any step, sharing a prefix), greedy
and seeded T 0.7; and 16 concurrent sampled rollouts teacher-force to every Δ 0.0."""

from __future__ import annotations

import copy
import random
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.model.invariant import mode
from lmtrace.model.lm import LM
from lmtrace.scoring.rollouts.report import rollouts
from lmtrace.server import create_app
from tests.server.conftest import RunningServer

WORDS = ["the", "cat", "sat", "on", "a", "blue", "mat", "and", "dog", "ran", "far", "over", "hills"]
SHARED = "the cat sat on the mat and the dog ran over the hills and far"


@pytest.fixture(scope="module")
def invariant_lm(tiny_lm):
    model = copy.deepcopy(tiny_lm.model)
    model.config.max_position_embeddings = 512
    mode.install(model)
    return LM.from_objects(model, tiny_lm.tokenizer, source="tiny-invariant")


def numbers(trace: dict) -> list:
    def alternatives(step: dict) -> list:
        return [(a["token_id"], a["logprob"], a["sampled_logprob"]) for a in step["top"]]

    return [(s["token_id"], s["logprob"], s["sampled_logprob"], s["entropy"], alternatives(s)) for s in trace["steps"]]


def concurrently(url: str, bodies: list[dict], stagger: float, seed: int) -> list[dict]:
    """Posts each body to /v1/traces on its own thread, starts spaced by up to `stagger` seconds."""
    answers: list[dict] = [{} for _ in bodies]
    rng = random.Random(seed)

    def post(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/traces", json=bodies[i])
            assert r.status_code == 200, r.text
            answers[i] = r.json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
        time.sleep(rng.uniform(0, stagger))
    for t in threads:
        t.join(120)
    return answers


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_request_alone_equals_it_among_staggered_requests(invariant_lm, temperature):
    rng = random.Random(7)
    base = {"max_tokens": 8, "temperature": temperature, "seed": 3, "top_logprobs": 5, "ignore_eos": True}
    needle = {**base, "prompt": SHARED + " the cat"}
    others = [{**base, "seed": i, "prompt": (SHARED if i % 2 else "") + " ".join(rng.choice(WORDS)
               for _ in range(rng.randint(3, 60)))} for i in range(9)]  # fmt: skip
    at = rng.randrange(len(others) + 1)
    app = create_app(invariant_lm, name="tiny", max_concurrency=16, max_batch=16)
    with RunningServer(app) as server:
        alone = concurrently(server.url, [needle], 0.0, 0)[0]
        together = concurrently(server.url, others[:at] + [needle] + others[at:], 0.03, 1)
    assert alone["model"]["config"]["batch_invariant"] is True
    assert app.state.lmtrace.worker.peak_rows > 1
    assert numbers(together[at]) == numbers(alone)


def test_rollouts_of_the_invariant_server_teacher_force_to_zero(invariant_lm, tiny_lm):
    bodies = [{"prompt": SHARED, "max_tokens": 10, "temperature": 0.7, "seed": s, "ignore_eos": True,
               "top_logprobs": 0} for s in range(16)]  # fmt: skip
    app = create_app(invariant_lm, name="tiny", max_concurrency=16, max_batch=16)
    with RunningServer(app) as server:
        traces = concurrently(server.url, bodies, 0.01, 2)
    records = [{"id": str(i), "prompt_ids": t["prompt"]["token_ids"], "completion_ids": [s["token_id"] for s in
                t["steps"]], "logprobs": [s["sampled_logprob"] for s in t["steps"]],
                "sampling": {"temperature": 0.7}} for i, t in enumerate(traces)]  # fmt: skip
    report = rollouts(invariant_lm, records)
    summary = report["summary"]
    assert summary["tokens"] == 160
    assert summary["mean_abs_delta"] == 0.0 and summary["k1"] == 0.0 and summary["bitwise_equal"] is True
    assert summary["causes"] == []
    plain = LM.from_objects(copy.deepcopy(tiny_lm.model), tiny_lm.tokenizer)  # the default operations
    assert lmtrace.rollouts(plain, records)["summary"]["bitwise_equal"] is False


def echo(c, prompt, max_tokens: int = 4) -> dict:
    """An echo completion (the requests that share the prefix cache): prompt and generated logprobs, top 5."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "logprobs": 5, "echo": True, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_a_prefix_cache_hit_equals_a_cold_prefill(invariant_lm):
    """A prompt that starts from an earlier prompt's cached KV (its new queries attend the cached
    columns: a causal mask offset by the cached length) gives the cold prefill's bits: the echoed
    prompt's logprobs and alternatives and the generated ones."""
    first, later = SHARED + " the cat", SHARED + " and the dog sat on a blue mat"
    with TestClient(create_app(invariant_lm, name="tiny", prefix_cache_bytes=0)) as c:
        cold = echo(c, later)
    with TestClient(create_app(invariant_lm, name="tiny")) as c:
        echo(c, first)
        hit = echo(c, later)
        again = echo(c, later)  # the whole prompt from the cache
    assert cached(cold) == 0 and cached(hit) > 0 and cached(again) == cold["usage"]["prompt_tokens"]
    assert hit["choices"] == cold["choices"] and again["choices"] == cold["choices"]


def test_prompts_packed_with_their_cache_hits_equal_cold_prefills(invariant_lm):
    """One request's prompts sharing beginnings with each other and with an earlier request (one
    packed forward: two hits on one cached entry, a prompt from another's beginning) give the bits
    each gets from a server without a prefix cache."""
    other = "a blue mat and the dog ran over the hills and far and the cat sat on the mat and"
    prompts = [SHARED + " the cat sat", SHARED + " and the dog sat on a blue mat", SHARED[:30] + " over a blue mat"]
    prompts += [other, other + " the dog ran"]
    with TestClient(create_app(invariant_lm, name="tiny", prefix_cache_bytes=0)) as c:
        cold = echo(c, prompts[1:], max_tokens=2)
    with TestClient(create_app(invariant_lm, name="tiny")) as c:
        echo(c, prompts[0], max_tokens=2)
        hit = echo(c, prompts[1:], max_tokens=2)
    assert cached(hit) > 0
    assert hit["choices"] == cold["choices"]
