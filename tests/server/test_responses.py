"""POST /v1/responses with the official `openai` client (its own types parse every answer and
event): text input, instructions, logprobs through `include` equal to /v1/traces within 1e-5,
the streaming events in OpenAI's order with the deltas adding up to the answer, text.format
json_schema, max_output_tokens giving an incomplete response, the fields clients send with their
defaults (background false, the extensions, a reasoning item sent back), and the fields it
refuses."""

from __future__ import annotations

import copy
import dataclasses
import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

INCLUDE = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def server(chat_lm):
    from lmtrace.server import create_app
    from tests.server.conftest import RunningServer

    with RunningServer(create_app(chat_lm, name="tiny")) as s:
        yield s


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _trace(server, messages, **kw):
    body = {"messages": messages, "temperature": 0, "top_logprobs": 5, **kw}
    return httpx.post(f"{server.url}/v1/traces", json=body, timeout=60).json()


def test_logprobs_equal_the_trace(oai, server):
    r = oai.responses.create(model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=8,
                             temperature=0, include=INCLUDE, top_logprobs=5)  # fmt: skip
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.model == "tiny"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    trace = _trace(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                   max_tokens=8)  # fmt: skip
    assert part.type == "output_text" and part.text == trace["text"] == r.output_text
    assert len(part.logprobs) == len(trace["steps"])
    for entry, step in zip(part.logprobs, trace["steps"]):
        assert abs(entry.logprob - step["logprob"]) <= 1e-5 and entry.bytes == step["bytes"]
        assert len(entry.top_logprobs) == 5
        for alt, want in zip(entry.top_logprobs, step["top"]):
            assert abs(alt.logprob - want["logprob"]) <= 1e-5
    assert r.usage.input_tokens == len(trace["prompt"]["token_ids"]) and r.usage.output_tokens == len(trace["steps"])
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_the_stream_is_openais_events(oai, server):
    kw = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
          "max_output_tokens": 8, "temperature": 0, "include": INCLUDE, "top_logprobs": 2}  # fmt: skip
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == whole.output_text == events[-2].item.content[0].text
    streamed = [lp.logprob for d in deltas for lp in d.logprobs]
    assert streamed == [lp.logprob for lp in whole.output[0].content[0].logprobs]
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_format(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    r = oai.responses.create(model="tiny", input="JSON", temperature=0, max_output_tokens=40, text={"format": fmt})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"include": ["file_search_call.results"]},
      "include"), ({"top_logprobs": 21, "include": INCLUDE}, "top_logprobs"), ({"tools": []}, "tools")],
)  # fmt: skip
def test_refused_fields(server, fields, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_fields_clients_send_with_their_defaults(oai, server):
    """background false (the client's Responses helpers send it), lmtrace's extensions as on chat,
    and an earlier answer sent back with its reasoning item."""
    kw = {"model": "tiny", "max_output_tokens": 4, "temperature": 0, "include": INCLUDE, "background": False}
    ext = {"top_k": 3, "min_p": 0.05, "repetition_penalty": 1.3, "ignore_eos": True, "logprobs_mode": "sampled"}
    r = oai.responses.create(input="Hello", **kw, extra_body=ext)
    assert r.background is False and r.status == "incomplete"
    trace = _trace(server, [{"role": "user", "content": "Hello"}], max_tokens=4, **ext)
    assert [lp.logprob for lp in r.output[0].content[0].logprobs] == [s["sampled_logprob"] for s in trace["steps"]]
    assert r.output_text == trace["text"]
    history = [{"role": "user", "content": "Hello"},
               {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "A greeting."}]},
               r.output[0].model_dump(exclude_none=True), {"role": "user", "content": "Again"}]  # fmt: skip
    again = oai.responses.create(input=history, **kw)
    plain = oai.responses.create(input=[history[0], history[2], history[3]], **kw)
    # the tiny model's template has no place for reasoning: the item is dropped, the prompt the same
    assert again.usage.input_tokens == plain.usage.input_tokens and again.output_text == plain.output_text


def test_a_reasoning_item_goes_to_a_template_with_a_place_for_it(chat_lm):
    from lmtrace.server.prepare import encode_chat
    from lmtrace.server.responses import ResponsesRequest, as_chat

    tok = copy.deepcopy(chat_lm.tokenizer)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m.reasoning_content %}<think>"
                         "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}\n{% endfor %}")  # fmt: skip
    thinking = dataclasses.replace(chat_lm, tokenizer=tok)
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Say hi back."}]}
    body = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "Hi"}, thought,
                                                      {"role": "assistant", "content": "Hello!"}]})  # fmt: skip
    _, text = encode_chat(thinking, as_chat(body).messages)
    assert text == "<|user|>Hi\n<|assistant|><think>Say hi back.</think>Hello!\n"
    _, plain = encode_chat(chat_lm, as_chat(body).messages)
    assert "Say hi back" not in plain  # a template without a place for it never sees it


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [({"background": True}, "background",
      "background: this server has no background mode (a response is answered in its request), got true"),
     ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input.[0].encrypted_content",
      "input[0].encrypted_content: this server cannot read encrypted reasoning")],
    ids=["background", "encrypted"],
)  # fmt: skip
def test_what_stays_refused_in_one_line(server, fields, param, message):
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", **fields})
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
