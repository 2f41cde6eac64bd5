"""The observers on completions and chat (lmtrace.server.observed; tiny model, in-process): a
request with `lens`, `attention` and `uncertainty` gets each token's entries in `observed` beside
its logprobs, equal to /v1/traces' steps and to lmtrace.generate's within the batched bound; the
trace's own entries (uncertainty's sequence scores) in `choices[].observed`; streamed equal to not
streamed; nothing added where none was asked; and the refusals in one line naming the field."""

from __future__ import annotations

import json

import pytest

import lmtrace
from tests.composability import differences
from tests.server.conftest import sse_events

TOL = 5e-5  # rows decoded in the server's batch (docs/tracing.md "Options together")
PROMPT = "Hello world"
USER = [{"role": "user", "content": PROMPT}]
ASK = {"max_tokens": 5, "temperature": 0, "lens": True, "attention": True, "uncertainty": True}
ROUTES = {
    "/v1/completions": {"prompt": PROMPT, "logprobs": 2},
    "/v1/chat/completions": {"messages": USER, "logprobs": True, "top_logprobs": 2},
}


def per_token(route: str, choice: dict) -> list:
    """The `observed` entries of a choice's tokens, in order."""
    if route == "/v1/chat/completions":
        return [c["observed"] for c in choice["logprobs"]["content"]]
    return choice["logprobs"]["observed"]


def streamed(route: str, chunks: list[dict]) -> tuple[list, dict]:
    """(each token's entries, the choice's own entries) gathered from a stream's chunks."""
    tokens, own = [], None
    for chunk in chunks:
        for c in chunk["choices"]:
            if c.get("logprobs"):
                tokens += per_token(route, c)
            if c["finish_reason"] is not None:
                own = c["observed"]
    return tokens, own


def reference(lm, route: str) -> lmtrace.Trace:
    return lmtrace.generate(
        lm,
        PROMPT,
        max_new_tokens=5,
        temperature=0,
        top_logprobs=2,
        lens=True,
        attention=True,
        uncertainty=True,
        chat=route == "/v1/chat/completions",
    )


def wanted(trace: dict) -> tuple[list, dict]:
    """What a trace's JSON says of the observers: each step's entries and the trace's own."""
    steps = [{k: s[k] for k in ("lens", "attention", "uncertainty")} for s in trace["steps"]]
    return steps, {"uncertainty": trace["uncertainty"]}


@pytest.mark.parametrize("route", list(ROUTES))
def test_entries_equal_the_trace_and_generate(client, chat_lm, route):
    answer = client.post(route, json={**ASK, **ROUTES[route]})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    got = (per_token(route, choice), choice["observed"])
    trace_fields = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": USER}
    served = client.post("/v1/traces", json={**ASK, **trace_fields, "top_logprobs": 2}).json()
    alone = json.loads(reference(chat_lm, route).to_json())
    assert len(got[0]) == 5 and got[0][0]["lens"]["layers"] and got[0][0]["attention"]["layers"]
    assert set(got[0][0]["uncertainty"]) >= {"confidence", "margin", "varentropy"}
    for want in (served, alone):
        assert differences(list(got), list(wanted(want)), TOL) == []
    # the entries' numbers are compared: another step's entries differ
    shifted = [got[0][1], *got[0][1:]]
    assert differences(shifted, wanted(alone)[0], TOL)


@pytest.mark.parametrize("route", list(ROUTES))
def test_streamed_equals_whole(client, route):
    body = {**ASK, **ROUTES[route], "n": 2, "temperature": 0.8, "seed": 3}
    whole = client.post(route, json=body).json()["choices"]
    chunks = sse_events(client.post(route, json={**body, "stream": True}).text)
    for i, choice in enumerate(whole):
        mine = [{**k, "choices": [c for c in k["choices"] if c["index"] == i]} for k in chunks]
        assert streamed(route, mine) == (per_token(route, choice), choice["observed"])
    assert "sampled_confidence" in per_token(route, whole[0])[0]["uncertainty"]  # sampled: both distributions


@pytest.mark.parametrize("route", list(ROUTES))
def test_absent_when_not_asked(client, route):
    body = {**ROUTES[route], "max_tokens": 3, "temperature": 0}
    whole = client.post(route, json=body).json()["choices"]
    chunks = sse_events(client.post(route, json={**body, "stream": True}).text)
    choices = whole + [c for k in chunks for c in k["choices"]]
    assert len(choices) > 2 and all("observed" not in c for c in choices)
    logprobs = [c["logprobs"] for c in choices if c["logprobs"]]
    entries = [e for lp in logprobs for e in lp.get("content", [])]
    assert logprobs and all("observed" not in lp for lp in logprobs) and all("observed" not in e for e in entries)


def test_echo_keeps_the_prompt_tokens_without_entries(client):
    body = {**ASK, **ROUTES["/v1/completions"], "echo": True, "lens": False, "attention": False}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    prompt = len(lp["tokens"]) - 5
    assert prompt > 0 and lp["observed"][:prompt] == [None] * prompt
    assert all(set(e) == {"uncertainty"} for e in lp["observed"][prompt:])


@pytest.mark.parametrize(
    ("route", "fields", "param", "words"),
    [
        ("/v1/chat/completions", {"messages": USER, "lens": True}, "lens", "lens needs logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "uncertainty": True}, "uncertainty", "uncertainty needs logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "waterfall": "all"}, "waterfall", "waterfall needs logprobs"),
        (
            "/v1/completions",
            {"prompt": PROMPT, "logprobs": 1, "logits_processors": ["nope"]},
            "logits_processors",
            "nope",
        ),
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "echo": True}, "echo", "echo"),
    ],
)
def test_refused_in_one_line(client, route, fields, param, words):
    answer = client.post(route, json={"max_tokens": 2, **fields})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and words in error["message"], answer.text
    assert "\n" not in error["message"]


def test_waterfall_and_attribution_on_the_openai_routes(client):
    """The waterfall and attribution, as /v1/traces takes them, beside each token's logprobs."""
    answer = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 3, "logprobs": True, "waterfall": "all", "attribution": True},
    )
    assert answer.status_code == 200, answer.text
    content = answer.json()["choices"][0]["logprobs"]["content"]
    assert all({"waterfall", "attribution"} <= set(c["observed"]) for c in content)
    assert all(c["observed"]["attribution"]["token_id"] is not None for c in content)
