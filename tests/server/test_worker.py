"""One generation at a time on the model thread; a bounded queue answered with 429 and
Retry-After beyond it; a client that goes away stops its generation and frees the model."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from lmtrace.server import create_app
from lmtrace.server.worker import END, Busy, Handle, ModelWorker
from tests.server.conftest import RunningServer


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_worker_admits_up_to_its_limit_then_frees_the_slot():
    async def main():
        worker = ModelWorker(limit=1)
        gate = threading.Event()
        first = worker.submit(lambda emit, check: gate.wait(5))
        with pytest.raises(Busy) as busy:
            worker.submit(lambda emit, check: None)
        assert busy.value.retry_after >= 1
        gate.set()
        assert [e async for e in first.events()] == []
        second = worker.submit(lambda emit, check: emit(("step", 1)))
        assert [e async for e in second.events()] == [("step", 1)]
        worker.shutdown()

    asyncio.run(main())


def slots_taken_at_each_end(worker: ModelWorker, monkeypatch) -> list[int]:
    """The worker's taken slots at the moment each answer's end is sent (filled as they are)."""
    taken: list[int] = []
    emit = Handle.emit

    def recording(handle, event):
        if event is END:
            taken.append(worker.admitted)
        emit(handle, event)

    monkeypatch.setattr(Handle, "emit", recording)
    return taken


def test_the_slot_is_free_before_the_answer_ends(monkeypatch):
    """The end of an answer is sent only after its slot is freed: a client that sends its next
    request the moment it has the answer is never told 429 (the other order raced)."""
    worker = ModelWorker(limit=1)
    admitted_at_end = slots_taken_at_each_end(worker, monkeypatch)

    async def main():
        for i in range(20):  # each request sent as soon as the one before has ended
            handle = worker.submit(lambda emit, check, i=i: emit(("step", i)))
            assert [e async for e in handle.events()] == [("step", i)]
        worker.shutdown()

    asyncio.run(main())
    assert admitted_at_end == [0] * 20


def test_a_cancelled_work_stops_and_the_next_runs():
    def endless(emit, check):
        for i in range(10_000):
            check()
            emit(("step", i))
            time.sleep(0.005)

    async def main():
        worker = ModelWorker(limit=2)
        first = worker.submit(endless)
        second = worker.submit(lambda emit, check: emit(("step", "next")))
        async for _ in first.events():
            first.cancel()
        assert [e async for e in second.events()] == [("step", "next")]
        assert (worker.cancelled, worker.finished) == (1, 1)
        worker.shutdown()

    asyncio.run(main())


def test_429_with_retry_after_when_the_queue_is_full(slow_lm):
    app = create_app(slow_lm, name="tiny", max_concurrency=1)
    worker = app.state.lmtrace.worker

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            long = asyncio.create_task(
                c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "ignore_eos": True})
            )
            while worker.admitted == 0:
                await asyncio.sleep(0.01)
            busy = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert busy.status_code == 429
            assert int(busy.headers["Retry-After"]) >= 1
            err = busy.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            assert (await long).status_code == 200
            while worker.admitted:
                await asyncio.sleep(0.01)
            assert (await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 200

    asyncio.run(main())
    worker.shutdown()


def test_a_client_that_disconnects_frees_the_model(slow_lm):
    with RunningServer(create_app(slow_lm, name="tiny", max_concurrency=2)) as server:
        worker = server.app.state.lmtrace.worker
        body = {"prompt": "Hi", "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                first = next(r.iter_lines())
                assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
            # the streaming client has gone: its generation stops at the next step
            wait_until(lambda: worker.cancelled == 1 and worker.admitted == 0)
            started = time.monotonic()
            ok = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert ok.status_code == 200 and time.monotonic() - started < 2.0

        # a non-streaming client that leaves while its answer is generated
        request = json.dumps({"prompt": "Hi", "max_tokens": 250, "ignore_eos": True}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(request)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + request)
            wait_until(lambda: worker.admitted == 1)
        wait_until(lambda: worker.cancelled == 2 and worker.admitted == 0)
        assert worker.finished == 1


def test_a_slot_frees_even_when_the_requests_event_loop_is_gone(tiny_lm):
    """A test client without `with` runs each request on an event loop of its own that ends with
    the answer: the slot is freed by the model thread itself, so admission never leaks (it
    did: 16 answered requests later every request was a 429)."""
    from fastapi.testclient import TestClient

    from lmtrace.server import create_app

    for max_batch in (1, 4):
        client = TestClient(create_app(tiny_lm, name="tiny", max_concurrency=2, max_batch=max_batch))
        for i in range(12):
            r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, (max_batch, i, r.text)
        worker = client.app.state.lmtrace.worker
        wait_until(lambda w=worker: w.admitted == 0)


def test_back_to_back_requests_on_one_slot_are_never_busy(tiny_lm, monkeypatch):
    """Through the server's batching worker (a decoded request, and a whole work of another route):
    with one slot, each request sent as soon as the last has ended is answered, because the slot
    is freed before the answer's end is sent."""
    from fastapi.testclient import TestClient

    client = TestClient(create_app(tiny_lm, name="tiny", max_concurrency=1, max_batch=2))
    worker = client.app.state.lmtrace.worker
    admitted_at_end = slots_taken_at_each_end(worker, monkeypatch)
    with client:
        for i in range(6):
            r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, (i, r.text)
            r = client.post("/tokenize", json={"prompt": "Hello"})
            assert r.status_code == 200, (i, r.text)
    assert 0 < len(admitted_at_end) and set(admitted_at_end) == {0}
