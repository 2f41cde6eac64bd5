"""A loop that never waits on one request: a large prompt is tokenized off the event loop (GET
/health answers meanwhile; tests/server/test_length.py: one far beyond the context is refused by
its length, before tokenizing), and the rows of a request of many rows join the batch round-robin
with room kept, so a single request that arrives meanwhile gets its first token within a few
steps rather than after the large one."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time

import httpx
from tokenizers import normalizers

from lmtrace.server import batcher, create_app
from tests.server.conftest import RunningServer


def test_health_answers_while_a_large_prompt_is_tokenized(chat_lm):
    # a tokenizer with a normalizer has no length bound (lmtrace.server.length): the prompt is
    # tokenized in full, then refused
    tok = copy.deepcopy(chat_lm.tokenizer)
    tok.backend_tokenizer.normalizer = normalizers.NFC()
    app = create_app(dataclasses.replace(chat_lm, tokenizer=tok), name="tiny", max_body_bytes=8 << 20)
    with RunningServer(app) as server:
        done = threading.Event()
        answer = {}

        def large():
            body = {"prompt": "Hello world, " * 200_000, "max_tokens": 1}  # 2.6 MB, far beyond the context
            answer["r"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            done.set()

        threading.Thread(target=large, daemon=True).start()
        time.sleep(0.5)  # the body is in; its tokenizing has begun
        started = time.perf_counter()
        assert httpx.get(f"{server.url}/health").status_code == 200
        waited = time.perf_counter() - started
        assert not done.is_set(), "the large prompt was refused before /health was asked: nothing was measured"
        assert waited < 0.5, waited
        assert done.wait(120)
        err = answer["r"].json()["error"]
        assert answer["r"].status_code == 400 and err["param"] == "prompt" and "too long" in err["message"]


def _stream(url: str, body: dict, arrivals: list, name: str) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append((name, time.perf_counter(), json.loads(line[6:])))


def test_a_single_request_is_not_held_back_by_a_large_one(chat_lm, monkeypatch):
    app = create_app(chat_lm, name="tiny", max_batch=8)
    worker = app.state.lmtrace.worker
    # the batch's decode steps, counted at the server: when the single request arrives, and when its
    # first token is chosen (a streaming client's reads lag the server's steps on a loaded machine)
    steps: dict[str, int] = {}
    submit, on_step = worker.submit_job, batcher._Request.on_step

    def counted_submit(job):
        if job.choices == 1:
            steps["arrived"] = worker.stats["steps"]
        return submit(job)

    def counted_on_step(self, choice):
        hook = on_step(self, choice)

        def first(step):
            if self.job.choices == 1:
                steps.setdefault("first", worker.stats["steps"])
            hook(step)

        return first

    monkeypatch.setattr(worker, "submit_job", counted_submit)
    monkeypatch.setattr(batcher._Request, "on_step", counted_on_step)
    arrivals: list = []
    with RunningServer(app) as server:
        big = {"prompt": ["Hi there"] * 8, "n": 8, "max_tokens": 40, "ignore_eos": True, "logprobs": 0}
        t = threading.Thread(target=_stream, args=(server.url, big, arrivals, "big"), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while not any(a[0] == "big" for a in arrivals):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _stream(server.url, {"prompt": "Hello", "max_tokens": 2, "logprobs": 0}, arrivals, "small")
        t.join(120)
    assert any(name == "small" for name, _, _ in arrivals)
    # the large request's 64 rows take 8 waves of 40 steps; the single one's first token comes
    # within a few of its steps (it rides in the next one's forward and is chosen at the one after)
    assert steps["first"] - steps["arrived"] <= 5, steps
    assert worker.stats["steps"] >= 5 * 40  # the large request was still decoding when it came
    assert worker.peak_rows == 8  # 7 of the large request and the small one
