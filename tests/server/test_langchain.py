"""LangChain's `ChatOpenAI.bind_tools` against a real server on a loopback port (skipped where
`langchain-openai` is not installed; the `test` extra has it): a tool given as a JSON schema,
tool_choice "required", a parsed tool call whose arguments validate against the schema (the
`jsonschema` package), and a `ToolMessage` turn that continues the conversation."""

from __future__ import annotations

import jsonschema
import pytest

from lmtrace.server import create_app
from tests.server.conftest import RunningServer

langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")

PARAMS = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer",
          "minimum": 1, "maximum": 7}, "now": {"type": "boolean"}}, "required": ["unit", "days", "now"],
          "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast",
           "parameters": PARAMS}}  # fmt: skip


@pytest.fixture(scope="module")
def chat_model(long_lm):
    with RunningServer(create_app(long_lm, name="tiny")) as server:
        yield langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="tiny",
                                          temperature=0, max_tokens=120, max_retries=0, timeout=120)  # fmt: skip


def test_bind_tools_required_gives_a_call_that_follows_the_schema(chat_model):
    question = messages.HumanMessage("What will the weather be in Paris?")
    answer = chat_model.bind_tools([WEATHER], tool_choice="required").invoke([question])
    assert isinstance(answer, messages.AIMessage) and answer.response_metadata["finish_reason"] == "tool_calls"
    assert not answer.invalid_tool_calls
    (call,) = answer.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], PARAMS)  # LangChain parsed the arguments; they follow the schema
    # the tool's answer sent back: the conversation goes on, the tool turn in the prompt
    result = messages.ToolMessage("18 degrees and sunny", tool_call_id=call["id"])
    after = chat_model.bind_tools([WEATHER]).invoke([question, answer, result])
    assert isinstance(after, messages.AIMessage)
    used, before = after.usage_metadata["input_tokens"], answer.usage_metadata["input_tokens"]
    assert used > before + len("18 degrees and sunny") // 2, (used, before)
