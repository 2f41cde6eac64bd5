"""Every failure answers with OpenAI's envelope {"error": {message, type, param, code}}: 400 for
bad requests (the CLI's rules and messages), 401 for a wrong key, 404 for an unknown model."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lmtrace.model.load import load
from lmtrace.server import create_app
from tests.server.conftest import sse_events


def envelope(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


BAD = [
    ({"temperature": -1}, "temperature", "temperature must be >= 0, got -1.0"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"min_p": 2}, "min_p", "min_p must be in [0, 1], got 2.0"),
    ({"top_k": -3}, "top_k", "top_k must be >= 0, got -3"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0, got 0.0"),
    ({"max_tokens": 0, "echo": False}, "max_tokens", "max_tokens must be >= 1, got 0"),
    ({"seed": -1}, "seed", "seed must be >= 0, got -1"),
    ({"seed": 2**70}, "seed", "seed must be < 2**64, got 1180591620717411303424"),
    ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
    ({"logprobs": -1}, "logprobs", "logprobs must be in [0, 20], got -1"),
    ({"n": 0}, "n", "n must be in [1, 16], got 0"),
    ({"stop": ["a", ""]}, "stop", "stop must be non-empty strings, got ''"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop takes at most 4 strings, got 5"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({"prompt": []}, "prompt", "prompt must not be empty"),
    ({"prompt": [1, 100000]}, "prompt", "prompt token ids must be in [0, 299], got 100000"),
    ({"prompt": {"a": 1}}, "prompt", "prompt must be a string or a list of token ids (integers)"),
    # OpenAI's list shapes: the element at fault is named
    ({"prompt": ["a", "b", "c", 4]}, "prompt", "prompt[3] must be a string or a list of token ids (integers)"),
    ({"prompt": ["a", ""]}, "prompt", "prompt[1] must not be empty"),
    ({"prompt": [[1, 2], []]}, "prompt", "prompt[1] must not be empty"),
    ({"prompt": [[1], [2, 300]]}, "prompt", "prompt[1] token ids must be in [0, 299], got 300"),
    ({"prompt": [[1], "a", [1.5]]}, "prompt", "prompt[2] must be a string or a list of token ids (integers)"),
    ({"temperature": "warm"}, "temperature", 'temperature: Input should be a valid number, got "warm"'),
    ({"max_tokens": 1.5}, "max_tokens", "max_tokens must be an integer, got 1.5"),
    ({"stream": "yes"}, "stream", 'stream: Input should be a valid boolean, got "yes"'),
    (
        {"frequency_penalty": 0.5},
        "frequency_penalty",
        "frequency_penalty is not supported by lmtrace serve (only 0), got 0.5",
    ),
    ({"best_of": 3}, "best_of", "best_of is not supported by lmtrace serve"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction",
     "Unrecognized request argument supplied: prediction"),
    # logit_bias (as vLLM's test_chat_logit_bias_validation: the id and the vocabulary's size named)
    ({"logit_bias": {"abc": 5}}, "logit_bias", "logit_bias: key 'abc' is not a token id (a non-negative integer)"),
    ({"logit_bias": {"-1": 5}}, "logit_bias", "logit_bias: key '-1' is not a token id (a non-negative integer)"),
    ({"logit_bias": {"301": 1}}, "logit_bias",
     "logit_bias: token id 301 is not in the vocabulary (300 tokens: ids 0 to 299)"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "logit_bias: the bias of token 1 must be in [-100, 100], got 101.0"),
    ({"logit_bias": {"1": "x"}}, "logit_bias.1", 'logit_bias.1: Input should be a valid number, got "x"'),
]


@pytest.mark.parametrize("fields,param,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_completion_requests(client, fields, param, message):
    err = envelope(client.post("/v1/completions", json={"prompt": "Hello", **fields}), 400)
    assert (err["message"], err["param"], err["type"]) == (message, param, "invalid_request_error")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity(client, literal):
    body = '{"prompt": "Hello", "temperature": ' + literal + "}"
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = envelope(r, 400)
    assert err["param"] == "temperature" and "must be a finite number" in err["message"]


def test_malformed_json_missing_fields_and_wrong_body(client):
    r = client.post("/v1/completions", content=b'{"prompt": "Hel', headers={"content-type": "application/json"})
    assert envelope(r, 400)["message"].startswith("the request body is not valid JSON")
    assert envelope(client.post("/v1/completions", json={}), 400) == {
        "message": "prompt is required",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    assert envelope(client.post("/v1/chat/completions", json={"max_tokens": 3}), 400)["param"] == "messages"
    assert (
        envelope(client.post("/v1/completions", json=["Hello"]), 400)["message"]
        == "the request body must be a JSON object"
    )


def test_prompt_beyond_the_context_gives_the_token_counts(client):
    err = envelope(client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 255}), 400)
    assert err["param"] == "max_tokens"
    assert "max_tokens is 255" in err["message"] and "256 tokens" in err["message"]
    long = {"messages": [{"role": "user", "content": "Hello world " * 200}]}
    assert "context holds 256 tokens" in envelope(client.post("/v1/chat/completions", json=long), 400)["message"]


def test_chat_errors(client, tiny_lm):
    msgs = [{"role": "user", "content": "Hi"}]
    err = envelope(client.post("/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2}), 400)
    assert err["message"] == "top_logprobs needs logprobs set to true"
    err = envelope(
        client.post("/v1/chat/completions", json={"messages": msgs, "logprobs": True, "top_logprobs": 30}), 400
    )
    assert err["message"] == "top_logprobs must be in [0, 20], got 30"
    assert envelope(client.post("/v1/chat/completions", json={"messages": []}), 400)["param"] == "messages"
    bad_role = {"messages": [{"role": "robot", "content": "Hi"}]}
    assert envelope(client.post("/v1/chat/completions", json=bad_role), 400)["param"] == "messages.[0].role"
    with TestClient(create_app(tiny_lm)) as plain:  # a model without a chat template
        err = envelope(plain.post("/v1/chat/completions", json={"messages": msgs}), 400)
        assert "no chat template" in err["message"]


def test_trace_errors(client):
    assert (
        envelope(client.post("/v1/traces", json={"max_tokens": 3}), 400)["message"] == "give either prompt or messages"
    )
    err = envelope(client.post("/v1/traces", json={"prompt": "Hi", "top_logprobs": 101}), 400)
    assert err["message"] == "top_logprobs must be in [0, 100], got 101"
    assert envelope(client.post("/v1/traces", json={"prompt": "Hi", "n": 2}), 400)["param"] == "n"


def test_unknown_model_and_route(client):
    err = envelope(client.post("/v1/completions", json={"prompt": "Hi", "model": "gpt-4"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert envelope(client.get("/v1/nothing"), 404)["message"] == "no route GET /v1/nothing"
    envelope(client.get("/v1/completions"), 405)


def test_api_key(chat_lm):
    with TestClient(create_app(chat_lm, name="tiny", api_key="s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            err = envelope(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers), 401)
            assert err["code"] == "invalid_api_key" and "s3cret" not in err["message"]
        # checked before the body is read: a bad body without the key is still a 401
        envelope(c.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}), 401)
        envelope(c.get("/v1/models"), 401)
        ok = c.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"Authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200
        # the page too needs the key, and /health never does (tests/server/test_security.py)
        assert c.get("/").status_code == 401 and c.get("/health").status_code == 200


def test_no_server_paths_in_answers(tiny_dir):
    lm = load(str(tiny_dir))
    with TestClient(create_app(lm)) as c:
        name = c.get("/v1/models").json()["data"][0]["id"]
        assert name == tiny_dir.name
        trace = c.post("/v1/traces", json={"prompt": "Hi", "max_tokens": 2}).text
        err = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 500}).text
        for text in (trace, err, c.get("/v1/models").text):
            assert str(tiny_dir.parent) not in text


def test_a_failure_while_generating_says_what_without_internals(chat_lm, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory in /home/someone/secret/model.py")

    monkeypatch.setattr(chat_lm.model, "forward", broken)  # every forward pass fails
    with TestClient(create_app(chat_lm, name="tiny"), raise_server_exceptions=False) as c:
        err = envelope(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 500)
        assert err == {"message": "internal error (RuntimeError)", "type": "server_error", "param": None, "code": None}
        streamed = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        )
        events = sse_events(streamed.text)  # the stream had started: the error is its last event
        assert events[-1]["error"]["type"] == "server_error" and "secret" not in streamed.text
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0}).status_code == 400  # still serving
