"""The server as a client's tools see it: the OpenAPI document at /openapi.json (and /docs,
/redoc; off with docs=False), its error answers the server's own (no FastAPI 422), 405 with
`Allow`, a body over the limit answered 413 before it is read, bodies that cannot be read
answered in the server's own words, whole-number floats taken for integer fields."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from lmtrace.server import create_app
from tests.server.conftest import RunningServer
from tests.server.test_errors import envelope


def test_the_schema_is_served_with_the_servers_own_errors(client):
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
            if "requestBody" in op:
                assert {"400", "404", "413", "429"} <= set(op["responses"]), (method, path)
    # the 400 documented is the one answered
    err = envelope(client.post("/v1/completions", json={"prompt": "Hi", "n": 0}), 400)
    assert set(err) == set(error["properties"]["error"]["properties"])
    assert client.get("/docs").status_code == 200 and "swagger" in client.get("/docs").text.lower()
    assert client.get("/redoc").status_code == 200


def test_no_docs(chat_lm):
    with TestClient(create_app(chat_lm, name="tiny", docs=False)) as c:
        for path in ("/openapi.json", "/docs", "/redoc"):
            envelope(c.get(path), 404)


def test_405_names_the_methods_in_allow(client):
    r = client.get("/v1/completions")
    err = envelope(r, 405)
    assert r.headers["allow"] == "POST" and "POST" in err["message"]
    r = client.delete("/v1/models")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_a_body_over_the_limit_is_413_before_it_is_read(chat_lm):
    app = create_app(chat_lm, name="tiny", max_body_bytes=1000)
    with RunningServer(app) as server:
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1})
        r = httpx.post(f"{server.url}/v1/completions", content=big, headers={"content-type": "application/json"})
        err = envelope(r, 413)
        assert (
            err["code"] == "request_too_large"
            and "at most" in err["message"]
            and f"({len(big)} bytes)" in err["message"]
        )

        def chunks():  # no Content-Length: counted as it streams in
            yield b'{"prompt": "'
            for _ in range(50):
                yield b"x" * 100
            yield b'"}'

        r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert envelope(r, 413)["code"] == "request_too_large"
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "the request body is required: a JSON object"),
        (b'{"prompt": "caf\xe9"}', "the request body is not UTF-8 text (byte 15 is 0xe9)"),
        (b"[" * 10000 + b"]" * 10000, "the request body nests 10000 levels deep; at most 512 are read"),
    ],
    ids=["empty", "not-utf8", "deep"],
)
def test_bodies_that_cannot_be_read(client, body, message):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = envelope(r, 400)
    assert err["message"] == message and err["type"] == "invalid_request_error"


def test_whole_number_floats_are_integers(client):
    base = {"prompt": "Hello", "temperature": 0}
    as_int = client.post("/v1/completions", json={**base, "max_tokens": 3, "logprobs": 2, "n": 1, "seed": 5}).json()
    as_float = client.post(
        "/v1/completions", json={**base, "max_tokens": 3.0, "logprobs": 2.0, "n": 1.0, "seed": 5.0}
    ).json()
    assert as_float["choices"] == as_int["choices"]
    ids = client.post("/v1/completions", json={**base, "prompt": [1, 2, 3], "max_tokens": 2}).json()
    floats = client.post("/v1/completions", json={**base, "prompt": [1.0, 2.0, 3.0], "max_tokens": 2}).json()
    assert floats["choices"] == ids["choices"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2.0, "logprobs": True, "top_logprobs": 1.0}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert (
        client.post("/detokenize", json={"tokens": [1.0, 2]}).json()
        == client.post("/detokenize", json={"tokens": [1, 2]}).json()
    )
    for field in ("max_tokens", "seed", "n", "logprobs"):
        err = envelope(client.post("/v1/completions", json={**base, field: 2.5}), 400)
        assert (err["message"], err["param"]) == (f"{field} must be an integer, got 2.5", field)
    err = envelope(client.post("/v1/completions", json={**base, "max_tokens": True}), 400)
    assert err["param"] == "max_tokens"


def test_rows_per_request_are_capped(chat_lm):
    with TestClient(create_app(chat_lm, name="tiny", max_rows=4)) as c:
        err = envelope(c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}), 400)
        assert (
            err["param"] == "n" and "6 rows (3 prompts times n 2)" in err["message"] and "at most 4" in err["message"]
        )
        assert c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1}).status_code == 200


def test_a_too_long_prompt_names_the_prompt_and_the_context(client):
    err = envelope(client.post("/v1/completions", json={"prompt": "Hello world " * 200, "max_tokens": 4}), 400)
    assert err["param"] == "prompt"
    assert err["message"].startswith("prompt is too long: it has ")
    assert "the model's context holds 256 tokens; with max_tokens 4 the prompt may have at most 252" in err["message"]
    err = envelope(
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * 400}]}), 400
    )
    assert err["param"] == "messages" and err["message"].startswith("chat prompt is too long")
    err = envelope(client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 255}), 400)
    assert err["param"] == "max_tokens" and "prompt has 5 tokens" in err["message"]
    assert "(max_tokens 251 at most with this prompt)" in err["message"]
