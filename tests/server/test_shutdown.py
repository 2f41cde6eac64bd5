"""SIGTERM: the server stops taking connections, lets requests in flight finish within
--shutdown-timeout, cancels the rest (503, or a last error event in a stream) and exits 0
without a traceback. In-process with the Runner (the signal sent to this very process, once
its handler is in place), then `lmtrace serve` itself as a subprocess."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lmtrace.server import create_app
from lmtrace.server.run import Runner
from tests.server.conftest import sse_events
from tests.server.process import free_port, start_serve
from tests.server.test_worker import wait_until

LONG = {"prompt": "Hi", "max_tokens": 250, "ignore_eos": True, "temperature": 0}


def first_chunk_then_rest(url: str, body: dict, got_first: threading.Event) -> tuple[int, str]:
    """A streamed completion read to its end, signalling when its first chunk has come."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = r.iter_text()
        text = next(chunks)
        got_first.set()
        return r.status_code, text + "".join(chunks)


def serve_and_terminate(app, timeout: float, scenario: Callable[[str, Callable[[], None]], dict]) -> dict:
    """Runs the app with Runner on this (main) thread while `scenario(url, terminate)` runs on
    another; `terminate` sends SIGTERM to this process. Returns the scenario's results with
    the seconds from the signal until Runner.run returned."""
    runner = Runner(app, "127.0.0.1", free_port(), timeout, log_level="warning")
    url = f"http://127.0.0.1:{runner.server.config.port}"
    out: dict = {}

    def terminate() -> None:
        assert signal.getsignal(signal.SIGTERM) == runner.stop  # never kill the test run itself
        out["signalled"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    def drive() -> None:
        try:
            wait_until(lambda: runner.server.started)
            out.update(scenario(url, terminate))
        except BaseException as e:  # reported on the main thread
            out["error"] = e
            runner.stop()
            runner.stop()

    driver = threading.Thread(target=drive)
    driver.start()
    runner.run()
    out["stopped_s"] = time.monotonic() - out.get("signalled", time.monotonic())
    driver.join(30)
    if "error" in out:
        raise out["error"]
    with pytest.raises(httpx.ConnectError):  # nothing listens any more
        httpx.get(url + "/health", timeout=2)
    return out


def test_requests_in_flight_finish_within_the_timeout(slow_lm):
    body = {"prompt": "Hi", "max_tokens": 30, "ignore_eos": True, "temperature": 0}

    def scenario(url: str, terminate) -> dict:
        alone = sse_events(first_chunk_then_rest(url, body, threading.Event())[1])
        got_first = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(first_chunk_then_rest, url, body, got_first)
            got_first.wait(30)
            terminate()
            return {"alone": alone, "streamed": streamed.result()}

    out = serve_and_terminate(create_app(slow_lm, name="tiny"), 20, scenario)
    status, text = out["streamed"]
    events = sse_events(text)
    assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"
    strip = [[c["text"] for c in e["choices"]] for e in events]
    assert strip == [[c["text"] for c in e["choices"]] for e in out["alone"]]  # whole, as without the signal
    assert out["stopped_s"] < 10, out["stopped_s"]  # did not wait out the 20 s once it was done


def test_requests_still_running_at_the_timeout_are_cancelled(slow_lm):
    app = create_app(slow_lm, name="tiny")

    def scenario(url: str, terminate) -> dict:
        got_first = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(first_chunk_then_rest, url, LONG, got_first)
            got_first.wait(30)
            waiting = pool.submit(httpx.post, url + "/v1/completions", json=LONG, timeout=60)
            wait_until(lambda: app.state.lmtrace.worker.admitted == 2)
            terminate()
            return {"streamed": streamed.result(), "waiting": waiting.result()}

    out = serve_and_terminate(app, 0.3, scenario)
    status, text = out["streamed"]
    last = sse_events(text)[-1]  # still a well-formed stream, ending in [DONE]
    assert status == 200 and last["error"]["code"] == "server_shutting_down"
    assert last["error"]["type"] == "server_error"
    waiting = out["waiting"]
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "server_shutting_down"
    assert out["stopped_s"] < 5, out["stopped_s"]
    assert app.state.lmtrace.worker.cancelled == 2


def test_lmtrace_serve_exits_0_on_sigterm(tiny_dir):
    proc, url = start_serve(tiny_dir, free_port(), "--shutdown-timeout", "1")
    try:
        got_first = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(first_chunk_then_rest, url, LONG, got_first)
            assert got_first.wait(30)
            waiting = pool.submit(httpx.post, url + "/v1/completions", json=LONG, timeout=60)
            time.sleep(0.2)  # admitted, behind the stream
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            code = proc.wait(timeout=30)
            took = time.monotonic() - signalled
            status, text = streamed.result()
            waiting = waiting.result()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert code == 0, err
    assert "Traceback" not in err and "ERROR" not in err, err
    # each request either finished or was told the server stopped: nothing hangs or breaks off
    last = sse_events(text)[-1]
    assert status == 200 and (last.get("error", {}).get("code") == "server_shutting_down" or last["choices"])
    assert waiting.status_code in (200, 503), waiting.text
    print(f"\nSIGTERM: exit 0 after {took:.2f} s; stream ended with {'an error' if 'error' in last else 'its answer'}, "
          f"the waiting request got {waiting.status_code}")  # fmt: skip
