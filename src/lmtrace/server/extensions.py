"""POST /v1/score and POST /v1/branch (lmtrace extensions, beside /v1/traces): the library's
`score` and `branch` on the served model, answered with the same JSON the CLI writes, so
`lmtrace score | branch --server URL` renders the answer without importing torch. The work runs
on the model thread (the worker, or between two steps of the batcher), never on the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from lmtrace.decode.branch import branch
from lmtrace.scoring.teacher.score import score
from lmtrace.server.errors import APIError, bad_request, failure
from lmtrace.server.generation import ServerState, check_draft
from lmtrace.server.prepare import check_common, check_model, params_for
from lmtrace.server.schemas import Int, Sampling, Text
from lmtrace.server.threaded import ThreadedRoute
from lmtrace.server.traces import served
from lmtrace.server.worker import Busy, ShuttingDown

router = APIRouter(route_class=ThreadedRoute)  # bodies parsed, answers encoded off the loop


class ScoreRequest(BaseModel):
    """`text`, or `prompt` with `continuation` (only the continuation is scored), teacher-forced."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    text: Text | None = None
    prompt: Text | None = None
    continuation: Text | None = None
    # Alternatives per token (0-100); tokens per forward pass and between windows (default: the context).
    top_logprobs: Int = 5
    window: Int | None = None
    stride: Int | None = None


class BranchRequest(Sampling):
    # The prompt; with `chat`, the user's message in the model's chat template.
    prompt: Text
    chat: bool = False
    # The step (0-based) whose token is replaced, by the raw distribution's ranks in
    # `alternatives` (default [2]) or by each of the `fan` most likely others.
    at: Int
    alternatives: list[Int] | None = None
    fan: Int | None = None
    top_logprobs: Int = 5
    lens: bool = False
    attention: bool | str = False


async def _run(state: ServerState, request: Request, job: Callable[[], Any]) -> Any:
    """Runs `job` on the model thread and waits for its result."""
    try:
        handle = state.worker.submit(lambda emit, check: emit(("done", job())))
    except Busy as e:
        raise APIError(429, f"{e}; retry after {e.retry_after} s", type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)}) from e  # fmt: skip
    result = None
    try:
        async for event in handle.events(request):
            if event[0] == "done":
                result = event[1]
    except ShuttingDown as e:
        raise failure(e) from None
    if result is None:
        handle.cancel()
        raise APIError(499, "client closed the request", code="client_closed_request")
    return result


@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request) -> Any:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    if (body.text is None) == (body.prompt is None or body.continuation is None):
        raise bad_request("give text, or prompt with continuation", "text")
    kw = {"prompt": body.prompt, "continuation": body.continuation, "top_logprobs": body.top_logprobs,
          "window": body.window, "stride": body.stride}  # fmt: skip
    result = await _run(state, request, lambda: score(state.lm, body.text, **kw))
    d = result.to_dict()
    d["model"] = {**d["model"], "source": state.name}
    return d


@router.post("/v1/branch")
async def create_branch(body: BranchRequest, request: Request) -> Any:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    check_common(body)
    params = params_for(body, 64 if body.max_tokens is None else body.max_tokens, body.top_logprobs, "top_logprobs")
    kw = {"fan": body.fan, "params": params, "chat": body.chat, "lens": body.lens, "attention": body.attention,
          **check_draft(state, body.draft_tokens, {"lens": body.lens, "attention": body.attention})}  # fmt: skip
    result = await _run(state, request, lambda: branch(state.lm, body.prompt, body.at, body.alternatives, **kw))
    d = result.to_dict()
    d["branches"] = [{**served(t, state.name), "label": b["label"]} for t, b in zip(result.traces, d["branches"])]
    return d
