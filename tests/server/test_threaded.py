"""Bodies parsed and answers encoded off the event loop (lmtrace.server.threaded): every route
that takes a body is a ThreadedRoute, and its answers are the bytes Starlette's JSONResponse
writes, a pydantic model or a tuple included."""

from __future__ import annotations

import json
import threading
import types

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel
from starlette.responses import JSONResponse

from lmtrace.server import chat, completions, create_app, extensions, responses, threaded, tokenization, traces
from lmtrace.server.threaded import ThreadedRoute, encoded


class Part(BaseModel):
    name: str
    score: float


def test_an_answer_is_the_bytes_jsonresponse_writes():
    content = {"a": [1, 2.5, -0.0, None, True], "é": 'naïve \u2028 "q"', "t": (1, 2), "nested": [{"x": {}}]}
    assert encoded(content).body == JSONResponse(content).body
    with_model = {"part": Part(name="n", score=0.5)}
    assert encoded(with_model).body == b'{"part":{"name":"n","score":0.5}}'
    assert encoded(with_model).media_type == "application/json"


def test_every_route_with_a_body_is_threaded():
    for module in (completions, chat, responses, traces, tokenization, extensions):
        posts = [r for r in module.router.routes if isinstance(r, APIRoute) and "POST" in r.methods]
        assert posts and all(isinstance(r, ThreadedRoute) for r in posts), module.__name__


def test_the_body_and_the_answer_are_handled_in_worker_threads(chat_lm, monkeypatch):
    seen = []

    def spy(name, fn):
        def recorded(*args, **kwargs):
            seen.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)

        return recorded

    monkeypatch.setattr(threaded, "encoded", spy("encoded", threaded.encoded))
    monkeypatch.setattr(threaded, "json", types.SimpleNamespace(loads=spy("loads", json.loads)))
    with TestClient(create_app(chat_lm, name="tiny")) as c:
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert sorted(name for name, _ in seen) == ["encoded", "loads"], seen
    assert all(thread.startswith("AnyIO worker thread") for _, thread in seen), seen
