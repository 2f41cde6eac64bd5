"""POST /v1/responses, OpenAI's Responses API for text: `input` (a string, or message items
whose content is a string or input_text parts), `instructions` (a system message before
them), `max_output_tokens`, `temperature`, `top_p`, `text.format` ({"type": "json_schema",
"name", "schema", "strict"} or {"type": "json_object"}), `include:
["message.output_text.logprobs"]` with `top_logprobs` (0-20), `stream`. The request runs as the
chat request it is (the same template, numbers and constraint), answered in the Responses
shapes: a `response` object whose `output` is one `message` item with one `output_text` part
(its `logprobs` as chat's entries), and when streamed OpenAI's events, `response.created` to
`response.completed`, each `response.output_text.delta` carrying its tokens' logprobs. Nothing is
stored: `previous_response_id` is refused, `store` accepted and ignored, `background` taken only
as false. A `reasoning` item of `input` (an earlier answer's output sent back) gives its text to
the next assistant message, for a chat template that has a place for it (as vLLM does); a
template without one never sees it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from lmtrace.records import Step, Trace
from lmtrace.server.errors import bad_request, failure
from lmtrace.server.generation import ServerState, collect, start, stream_parts
from lmtrace.server.logprobs import chat_entry
from lmtrace.server.prepare import Job, chat_job, check_model
from lmtrace.server.schemas import ChatRequest, Int, JsonSchemaFormat, ResponseFormat, Text
from lmtrace.server.sse import SSEResponse
from lmtrace.server.sse import sse as data_line
from lmtrace.server.threaded import ThreadedRoute

router = APIRouter(route_class=ThreadedRoute)  # bodies parsed, answers encoded off the loop
LOGPROBS = "message.output_text.logprobs"
EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "ignore_eos", "logprobs_mode")  # chat's, as they are


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class InputText(BaseModel):
    """A text part of a message item (`input_text`, or an earlier answer's `output_text`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(BaseModel):
    """A message item of `input` (OpenAI's EasyInputMessage and input message)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText] = Field(...)
    id: Text | None = None
    status: Text | None = None


class ReasoningText(BaseModel):
    """A part of a reasoning item: its summary's `summary_text` or its content's `reasoning_text`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["summary_text", "reasoning_text"]
    text: Text


class ReasoningItem(BaseModel):
    """A reasoning item of `input` (OpenAI's ResponseReasoningItem, an earlier answer's output)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        """Its reasoning: the content's text, else the summary's (vLLM's choice)."""
        return "\n\n".join(p.text for p in (self.content or self.summary))


def _kind(item: Any) -> str:
    return "reasoning" if isinstance(item, dict) and item.get("type") == "reasoning" else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_kind)
]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: Int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: Int | None = None
    include: list[Text] | None = None
    text: TextConfig | None = None
    stream: bool = False
    # Extensions, as on chat: the seed of the sampler, top_k, min_p, repetition_penalty,
    # ignore_eos and logprobs_mode ("raw" or "sampled").
    seed: Int | None = None
    top_k: Int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    logprobs_mode: Literal["raw", "sampled"] = "raw"
    # Accepted for compatibility: nothing is stored, no tools are run, no background mode (only
    # false), the prefix cache needs no key.
    store: bool | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    background: bool | None = None
    previous_response_id: Text | None = None


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `input`: a reasoning item's text goes with the next assistant message
    (where the chat template has a place for it: lmtrace.server.messages); one that no assistant
    message follows is dropped."""
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else []
    thought = None
    for i, item in enumerate([] if isinstance(body.input, str) else body.input):
        if isinstance(item, ReasoningItem):
            if item.encrypted_content is not None:
                raise bad_request(f"input[{i}].encrypted_content: this server cannot read encrypted reasoning",
                                  f"input.[{i}].encrypted_content")  # fmt: skip
            thought = item.text()
            continue
        content = item.content
        if isinstance(content, list):  # input_text / output_text parts are text parts
            content = [{"type": "text", "text": p.text} for p in content]
        items.append({"role": item.role, "content": content})
        if item.role == "assistant" and thought is not None:
            items[-1]["reasoning_content"], thought = thought, None
    if body.instructions is not None:
        items.insert(0, {"role": "system", "content": body.instructions})
    return items


def as_chat(body: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request is; its fields' errors name the Responses fields."""
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id: this server stores no responses", "previous_response_id")
    if body.background:
        raise bad_request("background: this server has no background mode (a response is answered in its "
                          "request), got true", "background")  # fmt: skip
    unknown = [i for i in body.include or [] if i != LOGPROBS]
    if unknown:
        raise bad_request(f"include: only {LOGPROBS!r} is served, got {unknown[0]!r}", "include")
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or fmt.name is None:
            raise bad_request("text.format: a json_schema format needs name and schema", "text.format")
        schema = JsonSchemaFormat.model_validate({"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict})
        response_format = ResponseFormat(type="json_schema", json_schema=schema)
    elif fmt is not None:
        response_format = ResponseFormat(type=fmt.type)
    logprobs = LOGPROBS in (body.include or [])
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise bad_request(f"top_logprobs must be in [0, 20], got {body.top_logprobs}", "top_logprobs")
    # top_logprobs without the include asks for nothing (as OpenAI's)
    extensions = {k: getattr(body, k) for k in EXTENSIONS}
    fields = {"messages": _messages(body), "max_tokens": body.max_output_tokens, "temperature": body.temperature,
              "top_p": body.top_p, "logprobs": logprobs, "top_logprobs": body.top_logprobs if logprobs else None,
              **extensions}  # fmt: skip
    try:
        chat = ChatRequest.model_validate(fields)
    except ValidationError as e:
        raise bad_request(f"input: {e.errors()[0]['msg']}", "input") from None
    chat.response_format = response_format
    return chat


def _entries(job: Job, steps: list[Step]) -> list[dict[str, Any]]:
    return [chat_entry(s, job.sampled) for s in steps] if job.logprobs else []


def _item(item_id: str, status: str, text: str | None, logprobs: list | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def response_object(head: dict[str, Any], job: Job, trace: Trace | None, item_id: str, cached: int = 0) -> dict:
    """The `response` object: in progress (no trace yet) or finished."""
    out = {**head, "output": [], "status": "in_progress", "incomplete_details": None, "usage": None}
    if trace is None:
        return out
    incomplete = trace.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    out["output"] = [_item(item_id, status, trace.text, _entries(job, trace.steps))]
    out["status"] = status
    out["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
    prompt, completion = len(job.ids), len(trace.steps)
    out["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                    "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": prompt + completion}  # fmt: skip
    return out


def _head(state: ServerState, body: ResponsesRequest, chat: ChatRequest) -> dict[str, Any]:
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": state.name, "error": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "top_logprobs": body.top_logprobs, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "text": {"format": fmt or {"type": "text"}}, "truncation": "disabled", "store": False,
            "metadata": body.metadata or {}, "user": body.user, "previous_response_id": None, "background": False,
            "reasoning": {"effort": None, "summary": None}}  # fmt: skip


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    chat = as_chat(body)
    job = await state.prepare(chat_job, chat)
    handle = start(state, job)
    head, item_id = _head(state, body, chat), f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return SSEResponse(_events(state, job, handle, request, head, item_id), handle.cancel)
    answer = await collect(handle, request)
    return response_object(head, job, answer.traces[0], item_id, sum(answer.cached.values()))


def _event(kind: str, seq: list[int], **fields: Any) -> str:
    seq[0] += 1
    return f"event: {kind}\n" + data_line({"type": kind, "sequence_number": seq[0] - 1, **fields})


async def _events(
    state: ServerState, job: Job, handle: Any, request: Request, head: dict, item_id: str
) -> AsyncIterator[str]:
    """OpenAI's streaming events; each delta carries the logprobs of the tokens its text
    releases (lmtrace.server.sse holds text back until it is final)."""
    seq = [0]
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield _event("response.created", seq, response=response_object(head, job, None, item_id))
    yield _event("response.in_progress", seq, response=response_object(head, job, None, item_id))
    yield _event("response.output_item.added", seq, output_index=0, item=_item(item_id, "in_progress", None, None))
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield _event("response.content_part.added", seq, **where, part=part)
    try:
        cached, trace = 0, None
        async for p in stream_parts(state, job, handle, request):
            if p.usage is not None:
                cached = p.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            elif p.trace is not None:
                trace = p.trace
            if p.text or (p.steps and job.logprobs):
                yield _event("response.output_text.delta", seq, **where, delta=p.text,
                             logprobs=_entries(job, [s for s, _ in p.steps]))  # fmt: skip
    except Exception as e:  # the stream has started: the error is its last event
        err = failure(e).body()["error"]
        yield _event("error", seq, code=err["code"], message=err["message"], param=err["param"])
        return
    if trace is None:  # the client left
        return
    done = response_object(head, job, trace, item_id, cached)
    item = done["output"][0]
    (part,) = item["content"]
    yield _event("response.output_text.done", seq, **where, text=part["text"], logprobs=part["logprobs"])
    yield _event("response.content_part.done", seq, **where, part=part)
    yield _event("response.output_item.done", seq, output_index=0, item=item)
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    yield _event(kind, seq, response=done)
