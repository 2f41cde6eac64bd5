"""POST /v1/traces (an lmtrace extension): the request fields of the OpenAI routes (`prompt`
or `messages`), answered with the full lmtrace trace: every step's raw and sampled logprobs,
rank, entropy, alternatives and KV-cache ledger. A list of prompts (OpenAI's shapes) is
answered with {"traces": [...]}, one per prompt, in order. With `stream`, one event per step
({"object": "trace.step", "index": i, "step": ...}) and then one {"object": "trace", "index": i,
"trace": ...} per prompt (`index` the prompt's place in the list, 0 for a single prompt).
With `tools` (and `messages`), the trace also carries `tool_calls`, and `fields` are the calls'
arguments."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from lmtrace.records import Trace
from lmtrace.server import tools
from lmtrace.server.errors import failure
from lmtrace.server.generation import ServerState, collect, start
from lmtrace.server.prepare import Job, check_model, trace_job
from lmtrace.server.schemas import TraceRequest
from lmtrace.server.sse import DONE, SSEResponse, sse
from lmtrace.server.threaded import ThreadedRoute
from lmtrace.server.worker import Handle

router = APIRouter(route_class=ThreadedRoute)  # bodies parsed, answers encoded off the loop


def served(trace: Trace, name: str) -> dict[str, Any]:
    """The trace as JSON, its model source given as the served name (never a server path)."""
    d = trace.to_dict()
    d["model"] = {**d["model"], "source": name}
    return d


@router.post("/v1/traces")
async def create_trace(body: TraceRequest, request: Request) -> Any:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    job = await state.prepare(trace_job, body, state.registered)
    handle = start(state, job)
    if body.stream:
        return SSEResponse(_events(state, job, handle, request), handle.cancel)
    traces = (await collect(handle, request)).traces
    if job.many:
        return {"traces": [served(t, state.name) for t in traces]}
    return with_calls(job, traces[0], state.name)


def with_calls(job: Job, trace: Trace, name: str) -> dict[str, Any]:
    """The served trace; with tools, also the calls read from it (`tool_calls`, OpenAI's shape)
    and `fields` as each call's arguments (paths `$.tool_calls[K].arguments...`)."""
    d = served(trace, name)
    if job.tools is not None:
        calls, _ = tools.read_calls(job.tools, trace.text)
        d["tool_calls"] = [c.to_openai() for c in calls]
        d["fields"] = tools.call_fields(trace, calls, job.tools.forced)
    return d


async def _events(state: ServerState, job: Job, handle: Handle, request: Request) -> AsyncIterator[str]:
    try:
        async for event in handle.events(request):
            if event[0] == "step":
                yield sse({"object": "trace.step", "index": event[1], "step": event[2].to_dict()})
            elif event[0] == "done":
                for i, trace in enumerate(event[1]):
                    yield sse({"object": "trace", "index": i, "trace": with_calls(job, trace, state.name)})
    except Exception as e:  # the stream has started: the error goes in an event
        yield sse(failure(e).body())
    yield DONE
