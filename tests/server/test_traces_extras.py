"""/v1/traces with echo, a waterfall, the attribution and processors the server registered by name
(create_app(logits_processors=...), lmtrace serve --logits-processor NAME=module:function): each
trace is generate's own (ids identical, numbers within the batched bound), in the continuous
batch and on a one-request-at-a-time server alike; a name the server does not know is a 400."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.server import create_app
from tests.composability import BATCHED_TOL, comparable, differences, no_top_token

BASE = {"max_tokens": 5, "temperature": 0, "top_logprobs": 2}
ASKED = {"echo": True, "waterfall": "all", "attribution": True, "logits_processors": ["no_top_token"]}


@pytest.fixture(scope="module", params=[8, 1], ids=["batching", "one-at-a-time"])
def app(request, tiny_lm):
    with TestClient(create_app(tiny_lm, max_batch=request.param, logits_processors=REGISTRY)) as client:
        yield client


REGISTRY = {"no_top_token": no_top_token, "by_path": "tests.composability:no_top_token"}


def test_a_trace_records_what_it_asked_for_as_generate(app, tiny_lm):
    r = app.post("/v1/traces", json={"prompt": "Once upon a time", **BASE, **ASKED})
    assert r.status_code == 200, r.text
    got = r.json()
    kw = {"max_new_tokens": 5, "temperature": 0, "top_logprobs": 2, "echo": True, "waterfall": "all"}
    alone = lmtrace.generate(tiny_lm, "Once upon a time", **kw, attribution=True, logits_processors=[no_top_token])
    alone = alone.to_dict()
    assert got["token_ids"] == alone["token_ids"] and got["params"]["logits_processors"] == ["no_top_token"]
    found = [d for d in differences(comparable(got), comparable(alone), BATCHED_TOL) if not d.startswith("$.model")]
    assert not found, found[:4]
    assert got["prompt_logprobs"] and all(s["waterfall"] and s["attribution"] for s in got["steps"])


def test_a_processor_registered_by_path_runs_under_its_registered_name(app):
    r = app.post("/v1/traces", json={"prompt": "Hello", **BASE, "logits_processors": ["by_path"], "waterfall": 0})
    assert r.status_code == 200, r.text
    trace = r.json()
    assert trace["params"]["logits_processors"] == ["by_path"]
    assert [s["stage"] for s in trace["steps"][0]["waterfall"]][:2] == ["raw", "by_path"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logits_processors": ["missing"]}, "logits_processors", ("'missing'", "no_top_token", "--logits-processor")),
        ({"waterfall": 7}, "waterfall", ("waterfall", "7")),
        ({"against": "rank:3"}, "against", ("attribution",)),
        ({"attribution": True, "against": "rank:0"}, "against", ("rank",)),
    ],
)
def test_a_request_that_asks_wrongly_is_a_400_naming_the_field(app, fields, param, words):
    r = app.post("/v1/traces", json={"prompt": "Hello", **BASE, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def test_the_servers_draft_and_a_requests_attribution_combine(tiny_lm):
    """A drafted request's attribution is its own verify forwards' (generate's with the draft);
    with draft_tokens 0, the plain run's."""
    with TestClient(create_app(tiny_lm, draft="layers:1", draft_tokens=3)) as client:
        for extra, draft in (({}, {"draft": "layers:1", "draft_tokens": 3}), ({"draft_tokens": 0}, {})):
            r = client.post("/v1/traces", json={"prompt": "Hello", **BASE, "attribution": True, **extra})
            assert r.status_code == 200, r.text
            alone = lmtrace.generate(
                tiny_lm, "Hello", max_new_tokens=5, temperature=0, top_logprobs=2, attribution=True, **draft
            )
            got = [s["attribution"] for s in r.json()["steps"]]
            found = differences(got, [s.attribution for s in alone.steps], BATCHED_TOL)
            assert not found and len(got) == len(alone.steps), found[:4]
