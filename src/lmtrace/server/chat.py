"""POST /v1/chat/completions, as OpenAI's: `messages` through the model's chat template,
`logprobs: true` (+ `top_logprobs` N) gives choices[].logprobs.content[] = {token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request

from lmtrace.server.generation import Part, ServerState, collect, new_id, openai_chunks, start, usage
from lmtrace.server.logprobs import chat_entry
from lmtrace.server.prepare import Job, chat_job, check_model
from lmtrace.server.schemas import ChatRequest
from lmtrace.server.sse import SSEResponse
from lmtrace.server.worker import Handle

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatRequest, request: Request) -> Any:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    job = await state.prepare(chat_job, body)
    handle = start(state, job)
    head = {"id": new_id("chatcmpl"), "created": int(time.time()), "model": state.name}
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(_chunks(state, job, handle, request, head, with_usage), handle.cancel)
    answer = await collect(handle, request)
    traces = answer.traces
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": t.text},
            "logprobs": {"content": [chat_entry(s, job.sampled) for s in t.steps]} if job.logprobs else None,
            "finish_reason": t.finish_reason,
        }
        for i, t in enumerate(traces)
    ]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage(job, traces, answer.cached)}


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
        logprobs = {"content": [chat_entry(s, job.sampled) for s, _ in part.steps]} if job.logprobs else None
        choice = {"index": part.choice, "delta": delta, "logprobs": logprobs, "finish_reason": part.finish_reason}
        yield {**head, "choices": [choice]}

    return openai_chunks(state, job, handle, request, head, with_usage, render)
