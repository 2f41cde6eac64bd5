"""Tools with the official `openai` client against a live `lmtrace serve` of the bundled model:
tool_choice "required" gives a parsed call whose arguments validate against the function's
schema (the `jsonschema` package), with per-argument confidence; sending the message and a
`tool` turn back continues the conversation; the Responses API's numbers equal /v1/traces."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
          "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": PARAMS}}  # fmt: skip


def test_a_required_call_and_the_tool_turn(bundled_server):
    client = openai.OpenAI(base_url=f"{bundled_server}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    c = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=40)  # fmt: skip
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS)
    fields = choice.model_extra["tool_call_fields"]
    assert {f["path"] for f in fields} == {"$.tool_calls[0].arguments.city", "$.tool_calls[0].arguments.unit"}
    assert all(0 < f["min_prob"] <= 1 for f in fields)
    # the same call on /v1/traces: its fields are the arguments, with the same numbers
    trace = httpx.post(f"{bundled_server}/v1/traces", json={"messages": messages, "tools": [WEATHER],
                       "tool_choice": "required", "temperature": 0, "max_tokens": 40}, timeout=300).json()  # fmt: skip
    assert trace["tool_calls"][0]["function"]["arguments"] == call.function.arguments
    assert [round(f["logprob"], 5) for f in trace["fields"]] == [round(f["logprob"], 5) for f in fields]
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    after = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=24)  # fmt: skip
    assert after.choices[0].message.role == "assistant" and after.usage.prompt_tokens > c.usage.prompt_tokens


def test_responses_numbers_equal_the_trace(bundled_server):
    client = openai.OpenAI(base_url=f"{bundled_server}/v1", api_key="unused", max_retries=0, timeout=300)
    kw = {"input": "Name a colour.", "max_output_tokens": 6, "temperature": 0,
          "include": ["message.output_text.logprobs"], "top_logprobs": 5}  # fmt: skip
    r = client.responses.create(model=client.models.list().data[0].id, **kw)
    trace = httpx.post(f"{bundled_server}/v1/traces", json={"messages": [{"role": "user", "content": "Name a colour."}],
                       "max_tokens": 6, "temperature": 0, "top_logprobs": 5}, timeout=300).json()  # fmt: skip
    got = r.output[0].content[0].logprobs
    assert r.output_text == trace["text"] and len(got) == len(trace["steps"])
    for entry, step in zip(got, trace["steps"]):
        assert abs(entry.logprob - step["logprob"]) <= 1e-5
        assert max(abs(a.logprob - b["logprob"]) for a, b in zip(entry.top_logprobs, step["top"])) <= 1e-5
    streamed = [lp for e in client.responses.create(model=r.model, **kw, stream=True)
                if e.type == "response.output_text.delta" for lp in e.logprobs]  # fmt: skip
    assert [round(lp.logprob, 6) for lp in streamed] == [round(lp.logprob, 6) for lp in got]
