"""POST /v1/chat/completions, as OpenAI's: `messages` through the model's chat template,
`logprobs: true` (+ `top_logprobs` N) gives choices[].logprobs.content[] = {token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}; `tools` and `tool_choice` give
message.tool_calls (lmtrace.server.tools); `lens`, `attention`, `uncertainty` (as /v1/traces
takes them) add each token's entries beside its logprobs (lmtrace.server.observed)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request

from lmtrace.records import Trace
from lmtrace.server import observed, tools
from lmtrace.server.errors import failure
from lmtrace.server.generation import Part, ServerState, collect, new_id, openai_chunks, start, usage
from lmtrace.server.logprobs import chat_entry
from lmtrace.server.prepare import Job, chat_job, check_model
from lmtrace.server.schemas import ChatRequest
from lmtrace.server.sse import DONE, SSEResponse, sse
from lmtrace.server.threaded import ThreadedRoute
from lmtrace.server.worker import Handle

router = APIRouter(route_class=ThreadedRoute)  # bodies parsed, answers encoded off the loop


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatRequest, request: Request) -> Any:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    job = observed.observe(state.lm, await state.prepare(chat_job, body), body, "logprobs", state.registered)
    handle = start(state, job)
    head = {"id": new_id("chatcmpl"), "created": int(time.time()), "model": state.name,
            "system_fingerprint": state.fingerprint}  # fmt: skip
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        if job.tools is not None:
            return SSEResponse(_whole(job, handle, request, head, with_usage), handle.cancel)
        return SSEResponse(_chunks(state, job, handle, request, head, with_usage), handle.cancel)
    answer = await collect(handle, request)
    traces = answer.traces
    choices = [choice(job, i, t) for i, t in enumerate(traces)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage(job, traces, answer.cached)}


def choice(job: Job, index: int, trace: Trace) -> dict[str, Any]:
    """One choice of the answer. With tools, a call the model made is the message's
    `tool_calls` (finish_reason "tool_calls"; a forced call the length limit cut is one too, its
    arguments as written, finish_reason "length"), and the extension `tool_call_fields` gives
    each argument's confidence."""
    out: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": trace.text}}
    observe = observed.observing(job)
    out["logprobs"] = {"content": [chat_entry(s, job.sampled, observe) for s in trace.steps]} if job.logprobs else None
    out["finish_reason"] = trace.finish_reason
    if observe:
        out[observed.NAME] = observed.trace_entries(trace)
    if job.tools is not None:
        calls, before = tools.read_calls(job.tools, trace.text)
        if calls:
            out["message"] = {"role": "assistant", "content": before or None,
                              "tool_calls": [c.to_openai() for c in calls]}  # fmt: skip
            out["finish_reason"] = "tool_calls" if all(c.complete for c in calls) else trace.finish_reason
            out["tool_call_fields"] = tools.call_fields(trace, calls, job.tools.forced)
    return out


async def _whole(job: Job, handle: Handle, request: Request, head: dict, with_usage: bool) -> AsyncIterator[str]:
    """A stream with tools: whether the answer is a call is known at its end, so each choice
    comes in one chunk then (the role, the content or tool_calls, its logprobs), as OpenAI's
    chunks shape them (tool_calls with an `index`)."""
    head = {**head, "object": "chat.completion.chunk"}
    try:
        answer = await collect(handle, request)
        for i, trace in enumerate(answer.traces):
            whole = choice(job, i, trace)
            delta = {**whole["message"]}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(delta["tool_calls"])]
            first = {"index": i, "delta": delta, "logprobs": whole["logprobs"], "finish_reason": None}
            yield sse({**head, "choices": [first]})
            last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": whole["finish_reason"]}
            for name in ("tool_call_fields", observed.NAME):
                if name in whole:
                    last[name] = whole[name]
            yield sse({**head, "choices": [last]})
        if with_usage:
            yield sse({**head, "choices": [], "usage": usage(job, answer.traces, answer.cached)})
    except Exception as e:  # the stream has started: the error goes in an event
        yield sse(failure(e).body())
    yield DONE


def _chunks(
    state: ServerState, job: Job, handle: Handle, request: Request, head: dict, with_usage: bool
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    started = [False] * job.n

    def render(part: Part) -> Iterator[dict[str, Any]]:
        if not started[part.choice]:  # OpenAI's first chunk of a choice names the role
            started[part.choice] = True
            first = {"role": "assistant", "content": ""}
            yield {**head, "choices": [{"index": part.choice, "delta": first, "logprobs": None, "finish_reason": None}]}
        delta = {"content": part.text} if part.text or part.finish_reason is None else {}
        observe = observed.observing(job)
        logprobs = {"content": [chat_entry(s, job.sampled, observe) for s, _ in part.steps]} if job.logprobs else None
        choice = {"index": part.choice, "delta": delta, "logprobs": logprobs, "finish_reason": part.finish_reason}
        if part.finish_reason is not None and observe:  # the trace's own entries, at its end
            choice[observed.NAME] = observed.trace_entries(part.trace)
        yield {**head, "choices": [choice]}

    return openai_chunks(state, job, handle, request, head, with_usage, render)
