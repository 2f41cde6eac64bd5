"""Integration: the server on the bundled SmolLM2-135M-Instruct (offline, slower)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.server import create_app
from tests.server.conftest import sse_events

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bundled_client(bundled_lm):
    with TestClient(create_app(bundled_lm)) as c:
        yield c


def test_greedy_logprobs_equal_generate(bundled_client, bundled_lm):
    body = {"prompt": "很久很久以前，", "max_tokens": 12, "temperature": 0, "logprobs": 5}
    d = bundled_client.post("/v1/completions", json=body).json()
    trace = lmtrace.generate(bundled_lm, "很久很久以前，", max_new_tokens=12, temperature=0, top_logprobs=5)
    assert d["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert d["choices"][0]["text"] == trace.text
    assert d["choices"][0]["logprobs"]["token_logprobs"] == [s.logprob for s in trace.steps]


def test_chat_ends_at_the_end_token_streamed_as_not(bundled_client, bundled_lm):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 48, "temperature": 0, "logprobs": True}
    plain = bundled_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    events = sse_events(bundled_client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert plain["finish_reason"] == "stop" and text == plain["message"]["content"]
    assert plain["logprobs"]["content"][-1]["token"] == "<|im_end|>"
    assert "<|im_end|>" not in text
