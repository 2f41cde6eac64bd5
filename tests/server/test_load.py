"""Load and faults on a real uvicorn server on a free loopback port: 32 requests from 8
concurrent clients (decoded together) each equal to the same request alone; a full queue answers 429 with
Retry-After and recovers; a client that disconnects frees the model within a second."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from lmtrace.server import create_app
from tests.same_record import assert_same
from tests.server.conftest import RunningServer, sse_events
from tests.server.test_worker import wait_until

CLIENTS = 8
PROMPTS = [
    "Hello world",
    "Once upon a time",
    "很久很久以前，",
    "🙂 naïve",
    "The quick brown fox",
    "a",
    "lazy dog",
    "Hi",
]
# fields that differ between two runs of the same request
VOLATILE = {"id", "created", "timing", "time_ms"}


def requests_32() -> list[tuple[str, dict]]:
    """Greedy requests over the three routes, streamed and not, plus seeded sampling (which
    must not depend on what else runs either)."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        stream = i % 2 == 1
        messages = [{"role": "user", "content": prompt}]
        out += [
            ("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, "stream": stream}),
            (
                "/v1/chat/completions",
                {
                    "messages": messages,
                    "max_tokens": 6,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "stream": not stream,
                },
            ),  # fmt: skip
            ("/v1/traces", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "top_logprobs": 3, "stream": stream}),
            (
                "/v1/completions",
                {
                    "prompt": prompt,
                    "max_tokens": 6,
                    "temperature": 0.9,
                    "seed": i,
                    "n": 2,
                    "logprobs": 1,
                    "stream": stream,
                },
            ),  # fmt: skip
        ]
    return out


def stable(obj):
    """The answer without what differs between runs (ids, timestamps, timings)."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def complete(path: str, body: dict, r: httpx.Response):
    """The answer, checked to be whole: 200, every choice finished, a stream ending in [DONE]."""
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events = sse_events(r.text)  # asserts the final [DONE]
        assert not any("error" in e for e in events)
        if path == "/v1/traces":
            assert events[-1]["object"] == "trace"
        else:
            finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
            assert finished == set(range(body.get("n", 1)))
        return stable(events)
    answer = r.json()
    if path != "/v1/traces":
        assert all(c["finish_reason"] for c in answer["choices"]) and len(answer["choices"]) == body.get("n", 1)
    return stable(answer)


def test_32_requests_from_8_clients_equal_each_alone(chat_lm):
    work = requests_32()
    app = create_app(chat_lm, name="tiny", max_concurrency=16)
    with RunningServer(app) as server:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            t_alone = time.monotonic()
            alone = [complete(p, b, c.post(p, json=b)) for p, b in work]
            t_alone = time.monotonic() - t_alone

        async def client(k: int) -> list:
            # one connection each; all in one thread, so that client threads do not compete
            # with the model thread for the interpreter
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return [(i, complete(*work[i], await c.post(work[i][0], json=work[i][1])))
                        for i in range(k, len(work), CLIENTS)]  # fmt: skip

        async def all_clients() -> list:
            return await asyncio.gather(*(client(k) for k in range(CLIENTS)))

        started = time.monotonic()
        together = [x for part in asyncio.run(all_clients()) for x in part]
        took = time.monotonic() - started
        assert sorted(i for i, _ in together) == list(range(32))
        for i, answer in together:
            # decoded in a batch with others: the same tokens and text, logprobs within the
            # documented batched-versus-alone bound
            assert_same(answer, alone[i], tol=1e-4)
        assert app.state.lmtrace.worker.finished == 64
        print(f"\nload: 32 requests from {CLIENTS} clients in {took:.1f} s ({t_alone:.1f} s one by one), all equal")


def test_a_full_queue_answers_429_then_recovers(slow_lm):
    app = create_app(slow_lm, name="tiny", max_concurrency=2)
    worker = app.state.lmtrace.worker
    long = {"prompt": "Hi", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    short = {"prompt": "Hello world", "max_tokens": 3, "temperature": 0}
    with RunningServer(app) as server, ThreadPoolExecutor(6) as pool:

        def post(body: dict) -> httpx.Response:
            return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        expected = post(short).json()["choices"]
        longs = [pool.submit(post, long) for _ in range(2)]
        wait_until(lambda: worker.admitted == 2)  # both slots taken: one generating, one waiting
        busy = list(pool.map(post, [short] * 4))
        for r in busy:
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert all(f.result().status_code == 200 for f in longs)  # the admitted ones were not disturbed

        def polite(body: dict) -> tuple[httpx.Response, int]:
            """Retries after each 429's Retry-After, as a polite client does."""
            for tries in range(1, 6):
                r = post(body)
                if r.status_code != 429:
                    return r, tries
                time.sleep(int(r.headers["Retry-After"]))
            return r, tries

        retried = list(pool.map(polite, [short] * 4))  # again 4 at once for 2 slots: some wait
        assert [r.status_code for r, _ in retried] == [200] * 4
        assert all(r.json()["choices"] == expected for r, _ in retried)
        wait_until(lambda: worker.admitted == 0)
        print(f"\n429: 4 of 4 refused with Retry-After, then all served after {max(t for _, t in retried)} tries")


def test_a_client_that_disconnects_frees_the_model_within_a_second(slow_lm):
    """Measured from the moment the client closes its connection to the moment the model
    thread has let go of the request (its slot free)."""
    app = create_app(slow_lm, name="tiny", max_concurrency=2)
    worker = app.state.lmtrace.worker
    body = {"prompt": "Hi", "max_tokens": 250, "ignore_eos": True}
    freed = []

    def time_to_free(cancelled: int, closed: float) -> float:
        wait_until(lambda: worker.cancelled == cancelled + 1 and worker.admitted == 0, timeout=10)
        return time.monotonic() - closed

    with RunningServer(app) as server:
        for _ in range(3):  # streaming: the client reads a chunk, then leaves
            cancelled = worker.cancelled
            with httpx.Client(base_url=server.url, timeout=30) as c:
                with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    next(r.iter_lines())
            freed.append(time_to_free(cancelled, time.monotonic()))
        for _ in range(2):  # not streaming: the client gives up waiting
            request = json.dumps(body).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(request)}\r\n\r\n"
            )
            cancelled = worker.cancelled
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(head.encode() + request)
                wait_until(lambda: worker.admitted == 1)
                time.sleep(0.1)  # generating
            freed.append(time_to_free(cancelled, time.monotonic()))
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert max(freed) < 1.0, freed
    assert worker.finished == 1
    print(f"\ndisconnect to free model: max {max(freed):.3f} s over {len(freed)} disconnects")
