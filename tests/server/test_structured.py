"""Constrained decoding on the server: OpenAI's response_format and vLLM's structured_outputs on
chat and completions, the CLI's keys on /v1/traces (answered with `fields` / `choices`), requests
with different constraints (and none) decoded together, each equal to itself alone, and bad
constraints answered 400 naming the field before the request waits for the model."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest

import lmtrace
from lmtrace.server import create_app
from tests.server.conftest import RunningServer, sse_events

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99},
          "tag": {"enum": ["red", "green"]}}, "required": ["ok", "n", "tag"]}  # fmt: skip
USER = [{"role": "user", "content": "Give me JSON"}]


def test_chat_response_format_json_schema_is_the_constrained_generation(client, chat_lm):
    body = {"messages": USER, "temperature": 0, "max_tokens": 40, "logprobs": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}
    answer = client.post("/v1/chat/completions", json=body).json()
    content = answer["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMA)
    alone = lmtrace.generate(chat_lm, "Give me JSON", chat=True, temperature=0, max_new_tokens=40, json_schema=SCHEMA)
    assert content == alone.text and answer["choices"][0]["finish_reason"] == "stop"
    got = [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]
    assert max(abs(a - s.logprob) for a, s in zip(got, alone.steps)) <= 1e-4  # raw logprobs, as without constraint
    streamed = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in streamed if e["choices"]) == content


@pytest.mark.parametrize(
    ("field", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]{2}"}}, lambda t: len(t) == 5 and t[2] == "-"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)
         is None),
        # any JSON object: the random tiny model writes one without end, so only its start is known
        ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith('{"')),
        ({"response_format": {"type": "json_object"}}, lambda t: t.startswith('{"')),
        ({"structured_outputs": {"grammar": 'root ::= "(" [a-z] [a-z]? ")"'}}, lambda t: t[0] == "(" and t[-1] == ")"),
    ],
    ids=["choice", "regex", "json", "json_object", "response_format_json_object", "grammar"],
)  # fmt: skip
def test_completions_structured_outputs(client, field, check):
    answer = client.post("/v1/completions", json={"prompt": "Hi", "temperature": 0, "max_tokens": 60, **field})
    choice = answer.json()["choices"][0]
    assert check(choice["text"]), choice["text"]
    assert choice["finish_reason"] == ("length" if "json_object" in json.dumps(field) else "stop")


def test_v1_traces_carry_fields_and_choices(client, chat_lm):
    base = {"prompt": "Hi", "temperature": 0}
    d = client.post("/v1/traces", json={**base, "max_tokens": 40, "json_schema": SCHEMA}).json()
    assert {f["path"] for f in d["fields"]} == {"$.ok", "$.n", "$.tag"} and all("grammar" in s for s in d["steps"])
    alone = lmtrace.generate(chat_lm, "Hi", temperature=0, max_new_tokens=40, json_schema=SCHEMA)
    assert d["token_ids"] == alone.token_ids and d["fields"][0]["path"] == alone.fields[0]["path"]
    d = client.post("/v1/traces", json={**base, "max_tokens": 9, "choice": ["a b", "c"]}).json()
    assert [c["text"] for c in d["choices"]] == ["a b", "c"]


BAD = [
    ({"regex": "(ab"}, "regex", "regex does not compile"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "json_schema: uniqueItems at #"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema does not compile"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema is required"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar",
     "structured_outputs.grammar does"),
    ({"structured_outputs": {"regex": "a", "choice": ["x", "y"]}}, "structured_outputs",
     "structured_outputs takes one"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json", "structured_outputs.json is not JSON"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "regex: one constraint at a time"),
    ({"choice": ["x"]}, "choice", "choice needs two options"),
    ({"regex": "a+", "ignore_eos": True}, "ignore_eos", "ignore_eos: a constrained output ends with the end token"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "message"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_constraint_is_a_400_naming_its_field(client, body, param, message):
    r = client.post("/v1/traces", json={"prompt": "Hi", "max_tokens": 4, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and error["message"].startswith(message), error


def test_a_grammar_that_allows_nothing_is_a_400_for_that_request_only(tiny_lm):
    """The request whose grammar allows no token fails alone; a request beside it finishes."""
    from tests.tiny import plain_tokenizer, tiny_model

    tok = plain_tokenizer()
    lm = lmtrace.LM.from_objects(tiny_model(tok), tok, source="plain")
    with RunningServer(create_app(lm, name="plain")) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        answers: dict[str, httpx.Response] = {}

        def post(name: str, body: dict) -> None:
            answers[name] = c.post("/v1/traces", json={"prompt": "the", "max_tokens": 8, "temperature": 0, **body})

        threads = [threading.Thread(target=post, args=a) for a in (("bad", {"regex": "Q+"}), ("good", {}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert answers["bad"].status_code == 400 and answers["bad"].json()["error"]["param"] == "regex"
    assert answers["good"].status_code == 200 and len(answers["good"].json()["steps"]) == 8


def test_requests_with_different_constraints_decode_together_each_as_alone(slow_lm):
    app = create_app(slow_lm, name="tiny", max_concurrency=8)
    bodies = {
        "json": {"prompt": "Hello", "json_schema": SCHEMA, "temperature": 0},
        "regex": {"prompt": "Once", "regex": "[a-d]{2,6}", "temperature": 0.9, "seed": 3},
        "choice": {"prompt": "The", "choice": ["the quick", "world"], "temperature": 0},
        "none": {"prompt": "很久", "temperature": 0},
    }
    answers: dict[str, dict] = {}
    with RunningServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as c:

        def post(name: str) -> None:
            answers[name] = c.post("/v1/traces", json={**bodies[name], "max_tokens": 24}).json()

        threads = [threading.Thread(target=post, args=(name,)) for name in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert app.state.lmtrace.worker.peak_rows > 1  # decoded together
    for name, body in bodies.items():
        kw = {k: v for k, v in body.items() if k != "prompt"}
        alone = lmtrace.generate(slow_lm, body["prompt"], max_new_tokens=24, **kw)
        assert answers[name]["token_ids"] == alone.token_ids, name
        mine = answers[name]["steps"]
        assert max(abs(a["logprob"] - s.logprob) for a, s in zip(mine, alone.steps)) <= 5e-5
        assert all(("grammar" in a) == (name != "none") for a in mine)
