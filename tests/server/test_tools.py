"""Tools on chat and /v1/traces (tiny model, in-process): a forced call decoded under the
function's schema (arguments valid JSON of it, with per-argument confidence), the tools in the
prompt (the system prompt for a template that knows no tools, the template's own otherwise), a
`tool` turn continuing the conversation, the stream's tool_calls chunk, calls read from free
text, and content parts and tool fields refused in OpenAI's words. A tool whose parameters are a
pydantic model's model_json_schema() (`$defs`, `$ref`, `anyOf`), with the requests of vLLM's
test_completion_with_function_calling: forced ("required", named) and called by the model itself
("auto"), and a forced call cut by the length limit, still a call."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Literal

import jsonschema
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from lmtrace.server import create_app
from lmtrace.server.schemas import ChatRequest
from lmtrace.server.tools import plan, read_calls
from tests.server.conftest import CHATML, sse_events
from tests.server.test_errors import envelope

PARAMS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "now": {"type": "boolean"}},
          "required": ["unit", "now"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]  # fmt: skip
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(long_lm):
    with TestClient(create_app(long_lm, name="tiny")) as c:
        yield c


def ask(client, **kw):
    body = {"messages": USER, "tools": TOOLS, "temperature": 0, "max_tokens": 120, **kw}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_follows_the_functions_schema(client, choice):
    answer = ask(client, tool_choice=choice, logprobs=True)
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    (call,) = answer["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    if call["function"]["name"] == "get_weather":
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS)
        fields = answer["tool_call_fields"]
        assert {f["path"] for f in fields} == {"$.tool_calls[0].arguments.unit", "$.tool_calls[0].arguments.now"}
        assert all(f["logprob"] <= 0 and 0 < f["min_prob"] <= 1 for f in fields)
    else:
        assert choice == "required" and json.loads(call["function"]["arguments"]) == {}


def test_traces_carry_the_call_and_its_fields(client):
    body = {"messages": USER, "tools": TOOLS, "temperature": 0, "max_tokens": 120,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    trace = client.post("/v1/traces", json=body).json()
    chat = ask(client, tool_choice=body["tool_choice"])
    (call,) = trace["tool_calls"]
    assert call["function"]["arguments"] == chat["message"]["tool_calls"][0]["function"]["arguments"]
    assert [f["path"] for f in trace["fields"]] == [f["path"] for f in chat["tool_call_fields"]]
    assert all(f["path"].startswith("$.tool_calls[0].arguments") for f in trace["fields"])
    # the template knows no tools: they are in the system prompt, and the answer opens the call
    prompt = trace["prompt"]["text"]
    assert prompt.startswith("<|system|># Tools") and '"name": "get_weather"' in prompt
    assert prompt.endswith("<|assistant|><tool_call>\n")


def test_a_tool_turn_continues_the_conversation(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]  # fmt: skip
    body = {"messages": history, "tools": TOOLS, "temperature": 0, "max_tokens": 5}
    trace = client.post("/v1/traces", json=body).json()
    prompt = trace["prompt"]["text"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>' in prompt
    assert "<|tool|><tool_response>\n18 degrees\n</tool_response>" in prompt
    assert ask(client, messages=history, max_tokens=5)["message"]["role"] == "assistant"


def test_a_template_that_knows_tools_renders_them(long_lm):
    tok = copy.deepcopy(long_lm.tokenizer)
    tok.chat_template = "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}" + tok.chat_template
    lm = dataclasses.replace(long_lm, tokenizer=tok)
    with TestClient(create_app(lm, name="tiny")) as c:
        trace = c.post("/v1/traces", json={"messages": USER, "tools": TOOLS, "max_tokens": 2}).json()
        assert (
            trace["prompt"]["text"].startswith('TOOLS=[{"type": "function"')
            and "# Tools" not in trace["prompt"]["text"]
        )


def test_tool_none_hides_the_tools_and_a_stream_carries_the_call(client):
    plain = client.post("/v1/traces", json={"messages": USER, "max_tokens": 2}).json()
    hidden = client.post("/v1/traces", json={"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    assert hidden.json()["prompt"]["text"] == plain["prompt"]["text"]
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 120}
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    whole = ask(client, tool_choice="required")
    (delta,) = [e["choices"][0]["delta"] for e in events if e["choices"][0]["delta"].get("tool_calls")]
    assert delta["tool_calls"][0]["index"] == 0
    streamed = delta["tool_calls"][0]["function"]
    assert streamed == whole["message"]["tool_calls"][0]["function"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_calls_read_from_free_text():
    body = ChatRequest.model_validate({"messages": USER, "tools": TOOLS})
    p = plan(body, "chatml")
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>'
    calls, before = read_calls(p, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"unit": "celsius"})]
    assert before == "Let me look."
    listed = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]</tool_call>'
    assert [c.name for c in read_calls(p, listed)[0]] == ["get_time"]
    assert read_calls(p, "Sunny, 18 degrees.") == ([], "Sunny, 18 degrees.")


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         'messages[0].content[0]: a text part needs "text" (a string)', "messages.[0].content.[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         'messages[0].content[0]: this model takes text only, got an "image_url" part', "messages.[0].content.[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"kind": "x"}]}]},
         'messages[0].content[1].type: a content part is of type "text", got none', "messages.[0].content.[1].type"),
        ({"messages": [{"role": "user", "content": 5}]},
         "messages[0].content must be a string or a list of content parts, got 5", "messages.[0].content"),
        ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
         "tool_choice names 'fly', which is not one of the tools", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice: one constraint at a time, got response_format and tool_choice", "tool_choice"),
    ],
    ids=["no-text", "image", "no-type", "content-number", "choice-alone", "unknown-name", "two-constraints"],
)  # fmt: skip
def test_errors_in_openais_words(client, fields, message, param):
    err = envelope(client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **fields}), 400)
    assert (err["message"], err["param"]) == (message, param)


# --- a tool defined with pydantic (vLLM's test_completion_with_function_calling: `$defs` at the root) ---


class Options(BaseModel):
    unit: Literal["celsius", "fahrenheit"] = "celsius"
    forecast: bool = False


class Weather(BaseModel):
    city: Literal["Paris", "Berlin"]
    options: Options | None  # anyOf [$ref, null]
    later: list[Options] = Field(default_factory=list, max_length=2)


PYDANTIC = Weather.model_json_schema()
FORECAST = {"type": "object", "properties": {"days": {"enum": [1, 5]}}, "required": ["days"],
            "additionalProperties": False}  # fmt: skip
PYDANTIC_TOOLS = [{"type": "function", "function": {"name": "get_current_weather", "parameters": PYDANTIC}},
                  {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}}]  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_current_weather"}}


def test_the_schema_is_pydantics_own():
    assert set(PYDANTIC["$defs"]) == {"Options"} and "anyOf" in PYDANTIC["properties"]["options"]
    assert PYDANTIC["properties"]["later"]["items"] == {"$ref": "#/$defs/Options"}


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_pydantic_tool_can_be_forced(client, choice):
    answer = ask(client, tools=PYDANTIC_TOOLS, tool_choice=choice, max_tokens=400)
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    (call,) = answer["message"]["tool_calls"]
    schema = {"get_current_weather": PYDANTIC, "get_forecast": FORECAST}[call["function"]["name"]]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, schema)  # its $refs resolved by jsonschema against the schema itself
    fields = answer["tool_call_fields"]
    assert fields and all(f["path"].startswith("$.tool_calls[0].arguments.") for f in fields)
    if choice == NAMED:  # /v1/traces: the same call, and a confidence for each of its values
        body = {"messages": USER, "tools": PYDANTIC_TOOLS, "tool_choice": NAMED, "temperature": 0, "max_tokens": 400}
        trace = client.post("/v1/traces", json=body).json()
        assert json.loads(trace["tool_calls"][0]["function"]["arguments"]) == arguments
        assert [f["path"] for f in trace["fields"]] == [f["path"] for f in fields]
        assert "$.tool_calls[0].arguments.city" in [f["path"] for f in fields]


def test_a_forced_call_cut_by_the_length_limit_is_still_a_call(client):
    body = {"messages": USER, "tools": PYDANTIC_TOOLS, "tool_choice": NAMED, "temperature": 0}
    whole = client.post("/v1/traces", json={**body, "max_tokens": 400}).json()["text"]
    opening = '{"name":"get_current_weather","arguments":'
    assert whole.startswith(opening)
    answer = ask(client, tools=PYDANTIC_TOOLS, tool_choice=NAMED, max_tokens=50)
    assert answer["finish_reason"] == "length" and answer["message"]["content"] is None
    (call,) = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_current_weather"
    cut = call["function"]["arguments"]
    assert cut and whole[len(opening) :].startswith(cut) and len(cut) < len(whole) - len(opening)
    events = sse_events(client.post("/v1/chat/completions", json={**body, "max_tokens": 50, "stream": True}).text)
    (delta,) = [e["choices"][0]["delta"] for e in events if e["choices"][0]["delta"].get("tool_calls")]
    assert delta["tool_calls"][0]["function"]["arguments"] == cut
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    one = ask(client, tools=PYDANTIC_TOOLS, tool_choice=NAMED, max_tokens=2)  # the name itself cut
    assert one["message"]["tool_calls"][0]["function"] == {"name": "get_current_weather", "arguments": ""}


@pytest.fixture(scope="module")
def scripted(tiny_tok):
    """A tiny model that, after any prompt, writes CALL token by token and then its end token (with
    tool_choice "auto" nothing is forced: the call is the model's own)."""
    from lmtrace.model.lm import LM
    from tests.tiny import tiny_model

    ids = tiny_tok(CALL, add_special_tokens=False)["input_ids"] + [tiny_tok.eos_token_id]
    model, state = tiny_model(tiny_tok), {"k": 0}
    model.config.max_position_embeddings = 4096  # the tools' system prompt: a token about every character
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = CHATML

    def force(module, args, kwargs, output):
        state["k"] = 0 if kwargs["input_ids"].shape[1] > 1 else state["k"] + 1  # prefill starts over
        logits = output.logits[:, -1, :]
        logits.fill_(-10.0)
        logits[:, ids[min(state["k"], len(ids) - 1)]] = 10.0

    model.register_forward_hook(force, with_kwargs=True)
    with TestClient(create_app(LM.from_objects(model, tok, source="tiny-call"), name="tiny", max_batch=1)) as c:
        yield c


CALL = ('Let me check.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Berlin", '
        '"options": {"unit": "fahrenheit", "forecast": true}}}\n</tool_call>')  # fmt: skip


def test_a_pydantic_tool_called_by_the_model_itself(scripted):
    answer = ask(scripted, tools=PYDANTIC_TOOLS, tool_choice="auto", max_tokens=200)
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] == "Let me check."
    (call,) = answer["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, PYDANTIC)
    assert arguments == {"city": "Berlin", "options": {"unit": "fahrenheit", "forecast": True}}
    body = {"messages": USER, "tools": PYDANTIC_TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 200}
    fields = {f["path"]: f for f in scripted.post("/v1/traces", json=body).json()["fields"]}
    assert set(fields) == {"$.tool_calls[0].arguments.city", "$.tool_calls[0].arguments.options.unit",
                           "$.tool_calls[0].arguments.options.forecast"}  # fmt: skip
    assert all(f["raw_logprob"] <= 0 for f in fields.values())
