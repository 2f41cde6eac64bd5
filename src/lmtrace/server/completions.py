"""POST /v1/completions, as OpenAI's legacy completions: `prompt` in OpenAI's four shapes (a
string, token ids, a list of strings, a list of token-id lists; choice `i * n + j` is prompt
i's j-th, each with the logprobs and echo of its own prompt), `logprobs` N gives {tokens,
token_logprobs, top_logprobs, text_offset}, `echo` puts the prompt
(and its tokens, the first with a null logprob) before the completion. `lens`, `attention`,
`uncertainty` (as /v1/traces takes them) add each token's entries: lmtrace.server.observed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request

from lmtrace.records import Trace
from lmtrace.server import observed
from lmtrace.server.generation import Part, ServerState, collect, new_id, openai_chunks, start, usage
from lmtrace.server.logprobs import CompletionLogprobs, PromptToken
from lmtrace.server.prepare import Job, check_model, completion_job
from lmtrace.server.schemas import CompletionRequest
from lmtrace.server.sse import SSEResponse, answer_pieces
from lmtrace.server.threaded import ThreadedRoute
from lmtrace.server.worker import Handle
from lmtrace.stops import finish_reason

router = APIRouter(route_class=ThreadedRoute)  # bodies parsed, answers encoded off the loop


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    job = observed.observe(state.lm, await state.prepare(completion_job, body), body, "logprobs", state.registered)
    handle = start(state, job)
    head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": state.name,
            "system_fingerprint": state.fingerprint}  # fmt: skip
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(_chunks(state, job, handle, request, head, with_usage), handle.cancel)
    answer = await collect(handle, request)
    traces = answer.traces
    choices = [_choice(job, i, t, answer.prompt.get(i // job.n)) for i, t in enumerate(traces or [None] * job.choices)]
    return {**head, "choices": choices, "usage": usage(job, traces, answer.cached)}


def _choice(job: Job, index: int, trace: Trace | None, prompt: list[PromptToken] | None) -> dict[str, Any]:
    text = trace.text if trace else ""
    prompt_text = job.prompt_of(index).text
    logprobs = None
    if job.logprobs:
        lp = CompletionLogprobs(0 if job.echo else len(prompt_text), observed.observing(job))
        if job.echo:
            lp.add_prompt(prompt or [], prompt_text)
            lp.offset = len(prompt_text)
        steps = trace.steps if trace else []
        for step, piece in zip(steps, answer_pieces(steps, text)):
            lp.add_step(step, piece, job.sampled)
        logprobs = lp.to_dict()
    out = {
        "index": index,
        "text": (prompt_text if job.echo else "") + text,
        "logprobs": logprobs,
        "finish_reason": trace.finish_reason if trace else finish_reason(False, False, True, openai=True),
    }
    if observed.observing(job):
        out[observed.NAME] = observed.trace_entries(trace)
    return out


def _chunks(
    state: ServerState, job: Job, handle: Handle, request: Request, head: dict, with_usage: bool
) -> AsyncIterator[str]:
    offsets = [len(job.prompt_of(i).text) for i in range(job.choices)]  # where each choice's next token starts

    def render(part: Part) -> Iterator[dict[str, Any]]:
        logprobs = None
        if job.logprobs and (part.steps or part.prompt is not None):
            lp = CompletionLogprobs(0 if part.prompt is not None else offsets[part.choice], observed.observing(job))
            if part.prompt is not None:
                lp.add_prompt(part.prompt, job.prompt_of(part.choice).text)
            else:
                for step, piece in part.steps:
                    lp.add_step(step, piece, job.sampled)
                offsets[part.choice] = lp.offset
            logprobs = lp.to_dict()
        choice = {"index": part.choice, "text": part.text, "logprobs": logprobs, "finish_reason": part.finish_reason}
        if part.finish_reason is not None and observed.observing(job):  # the trace's own entries, at its end
            choice[observed.NAME] = observed.trace_entries(part.trace)
        yield {**head, "choices": [choice]}

    return openai_chunks(state, job, handle, request, head, with_usage, render)
