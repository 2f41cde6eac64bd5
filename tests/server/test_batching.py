"""Concurrent requests decoded together: a request that arrives while another generates joins
its batch at the next step, with its own settings, and finishes without waiting for it; each
answer is the one it gets alone."""

from __future__ import annotations

import json
import threading

import httpx

import lmtrace
from lmtrace.model.draft import draft_for
from lmtrace.server import create_app
from lmtrace.server.worker import ModelWorker
from tests.same_record import assert_same
from tests.server.conftest import RunningServer
from tests.server.test_worker import wait_until


def test_a_request_joins_a_running_generation_and_leaves_first(slow_lm):
    app = create_app(slow_lm, name="tiny", max_concurrency=4)
    worker = app.state.lmtrace.worker
    long = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "temperature": 0, "logprobs": 1}
    short = {"prompt": "Hi", "max_tokens": 5, "temperature": 0.8, "top_k": 20, "seed": 7, "logprobs": 3}
    with RunningServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        chunks: list[str] = []

        def stream_long() -> None:
            with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                chunks.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream_long)
        reader.start()
        wait_until(lambda: worker.peak_rows == 1)  # the long one is generating
        with httpx.Client(base_url=server.url, timeout=60) as c2:
            answer = c2.post("/v1/completions", json=short).json()
        assert worker.peak_rows == 2  # decoded together
        assert worker.finished == 1 and reader.is_alive()  # done while the long one still runs
        # the short one's prompt was prefilled in the long one's decode forward, not in one of its own
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "lmtrace_decode_steps_with_prefill_total 1" in metrics
        reader.join(60)
    alone = lmtrace.generate(slow_lm, "Hi", max_new_tokens=5, temperature=0.8, top_k=20, seed=7, top_logprobs=3)
    assert answer["choices"][0]["text"] == alone.text
    got = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - s.logprob) for a, s in zip(got, alone.steps)) <= 1e-4
    streamed = "".join(
        json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in chunks if line != "data: [DONE]"
    )
    alone = lmtrace.generate(slow_lm, "Once upon a time", max_new_tokens=100, temperature=0, stop_on_eos=False)
    assert streamed == alone.text


def test_max_batch_1_is_one_request_at_a_time(chat_lm):
    assert type(create_app(chat_lm, max_batch=1).state.lmtrace.worker) is ModelWorker


def test_lens_draft_and_plain_requests_decode_together_each_as_alone(slow_lm):
    """Four concurrent requests on a server with a draft: one with the lens and the attention, one
    with the draft, two plain; all four are in the continuous batch at once, and each answer is
    the one it gets alone (the drafted row exactly; the others within batched float noise)."""
    draft = draft_for(slow_lm, "layers:1")
    app = create_app(slow_lm, name="tiny", max_concurrency=8, draft=draft, draft_tokens=3)
    worker = app.state.lmtrace.worker
    long = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "logprobs": 1,
            "draft_tokens": 0}  # fmt: skip
    plain = {"prompt": "Hi", "max_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 7, "logprobs": 3,
             "draft_tokens": 0, "ignore_eos": True}  # fmt: skip
    inside = {"prompt": "The cat", "max_tokens": 10, "temperature": 0, "lens": True, "attention": True,
              "draft_tokens": 0, "ignore_eos": True}  # fmt: skip
    drafted = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "draft_tokens": 2, "ignore_eos": True}
    answers: dict[str, dict] = {}
    with RunningServer(app) as server:

        def post(name: str, route: str, body: dict) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                answers[name] = c.post(route, json=body).json()

        calls = [("plain", "/v1/completions", plain), ("inside", "/v1/traces", inside),
                 ("drafted", "/v1/traces", drafted)]  # fmt: skip
        first = threading.Thread(target=post, args=("long", "/v1/completions", long))
        first.start()
        wait_until(lambda: worker.peak_rows == 1)
        threads = [threading.Thread(target=post, args=call) for call in calls]
        for t in threads:
            t.start()
        for t in (*threads, first):
            t.join(60)
    assert worker.peak_rows == 4  # all four decoded together
    long_alone = lmtrace.generate(slow_lm, "Once upon a time", max_new_tokens=40, temperature=0, stop_on_eos=False)
    assert answers["long"]["choices"][0]["text"] == long_alone.text
    plain_alone = lmtrace.generate(slow_lm, "Hi", max_new_tokens=12, temperature=0.8, top_k=20, seed=7,
                                   top_logprobs=3, stop_on_eos=False)  # fmt: skip
    assert answers["plain"]["choices"][0]["text"] == plain_alone.text
    got = answers["plain"]["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - s.logprob) for a, s in zip(got, plain_alone.steps)) <= 1e-4
    inside_alone = lmtrace.generate(slow_lm, "The cat", max_new_tokens=10, temperature=0, lens=True,
                                    attention=True, stop_on_eos=False)  # fmt: skip
    traced = answers["inside"]
    assert traced["token_ids"] == inside_alone.token_ids
    for got_step, want in zip(traced["steps"], inside_alone.steps):
        assert_same(got_step["lens"], json.loads(json.dumps(want.lens)), tol=1e-4)
        assert_same(got_step["attention"], json.loads(json.dumps(want.attention)), tol=1e-4)
    drafted_alone = lmtrace.generate(slow_lm, "Hello world", max_new_tokens=12, temperature=0, draft=draft,
                                     draft_tokens=2, stop_on_eos=False)  # fmt: skip
    want = json.loads(drafted_alone.to_json())
    assert answers["drafted"]["token_ids"] == drafted_alone.token_ids
    assert_same(answers["drafted"]["steps"], want["steps"], tol=1e-6)
    assert answers["drafted"]["speculative"]["blocks"] == want["speculative"]["blocks"]
