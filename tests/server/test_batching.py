"""Concurrent requests decoded together: a request that arrives while another generates joins
its batch at the next step, with its own settings, and finishes without waiting for it; each
answer is the one it gets alone."""

from __future__ import annotations

import json
import threading

import httpx

import lmtrace
from lmtrace.server import create_app
from lmtrace.server.worker import ModelWorker
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
        reader.join(60)
    alone = lmtrace.generate(slow_lm, "Hi", max_new_tokens=5, temperature=0.8, top_k=20, seed=7, top_logprobs=3)
    assert answer["choices"][0]["text"] == alone.text
    got = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - s.logprob) for a, s in zip(got, alone.steps)) <= 1e-4
    streamed = "".join(
        json.loads(line.removeprefix("data: "))["choices"][0]["text"]
        for line in chunks
        if line != "data: [DONE]"
    )
    alone = lmtrace.generate(slow_lm, "Once upon a time", max_new_tokens=100, temperature=0, stop_on_eos=False)
    assert streamed == alone.text


def test_max_batch_1_is_one_request_at_a_time(chat_lm):
    assert type(create_app(chat_lm, max_batch=1).state.lmtrace.worker) is ModelWorker


def test_a_lens_request_runs_between_the_batch_steps_not_beside_them(slow_lm):
    """Lens and attention swap the model's attention function: such a request runs on the
    batcher's own model thread between two steps, and both answers stay what they are alone."""
    app = create_app(slow_lm, name="tiny", max_concurrency=4)
    worker = app.state.lmtrace.worker
    long = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0, "logprobs": 1}
    inside = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "lens": True, "attention": True}
    with RunningServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        answers: list[dict] = []
        reader = threading.Thread(target=lambda: answers.append(c.post("/v1/completions", json=long).json()))
        reader.start()
        wait_until(lambda: worker.peak_rows == 1)
        with httpx.Client(base_url=server.url, timeout=60) as c2:
            traced = c2.post("/v1/traces", json=inside).json()
        assert reader.is_alive()  # it ran while the long one was still generating
        reader.join(60)
    alone = lmtrace.generate(slow_lm, "Hi", max_new_tokens=4, temperature=0, lens=True, attention=True)
    assert [s["token_id"] for s in traced["steps"]] == [s.token_id for s in alone.steps]
    assert [s["logprob"] for s in traced["steps"]] == [s.logprob for s in alone.steps]
    assert [s["lens"] for s in traced["steps"]] == [json.loads(json.dumps(s.lens)) for s in alone.steps]
    long_alone = lmtrace.generate(slow_lm, "Once upon a time", max_new_tokens=60, temperature=0, stop_on_eos=False)
    assert answers[0]["choices"][0]["text"] == long_alone.text
