"""What a job does on the model thread, and how a route gets the results back: as events for
a stream, or all at once. The one place where the server calls the tracing library."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from lmtrace import __version__
from lmtrace.decode.continuous import RowSpec, generate_rows
from lmtrace.decode.tracing import generate_ids
from lmtrace.model.lm import LM
from lmtrace.records import Step, Trace
from lmtrace.registered import Registered
from lmtrace.server import compiled
from lmtrace.server.batcher import BatchingWorker
from lmtrace.server.errors import APIError, bad_request, failure
from lmtrace.server.lane import echo_alone
from lmtrace.server.logprobs import PromptToken
from lmtrace.server.prepare import Job, row_options
from lmtrace.server.sse import DONE, ChoiceStream, sse
from lmtrace.server.worker import Busy, Emit, Handle, ModelWorker, ShuttingDown, Work
from lmtrace.stops import finish_reason


@dataclass
class ServerState:
    """What the routes share: the model, the name it is served under, the worker, and `front`:
    the same model with its own tokenizer copy, for encoding requests on the event loop while
    the model thread decodes (a fast tokenizer used from two threads can fail "Already
    borrowed"). Requests are prepared with it off the event loop, one at a time (`prepare`)."""

    lm: LM
    name: str
    worker: ModelWorker
    created: int = field(default_factory=lambda: int(time.time()))
    # speculative decoding (lmtrace serve --draft): the draft model and its default block size
    draft: Any = None
    draft_tokens: int | str = 4
    max_rows: int = 1024  # rows (prompts times n) one request may ask for
    # the processors and observers requests may name (lmtrace serve --logits-processor
    # NAME=module:function, --observer NAME=module:Class)
    registered: Registered = field(default_factory=Registered)
    # whether requests may ask for the compiled step (lmtrace serve --compile; lmtrace.server.compiled)
    compile: bool = False
    front: LM = field(init=False)
    front_lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    # OpenAI's system_fingerprint of chat and completion answers (`fingerprint(lm)`)
    fingerprint: str = field(init=False)

    async def prepare(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(front, *args)` (tokenizing, templating, compiling a constraint) in a worker
        thread, so that a large prompt never holds up the event loop; one at a time, as the
        front tokenizer is one."""

        def locked() -> Any:
            with self.front_lock:
                return fn(self.front, *args)

        return await run_in_threadpool(locked)

    def __post_init__(self) -> None:
        self.fingerprint = fingerprint(self.lm)
        try:
            self.front = dataclasses.replace(self.lm, tokenizer=copy.deepcopy(self.lm.tokenizer))
        except Exception:  # a tokenizer that cannot be copied is shared
            self.front = self.lm

    def is_eos(self, job: Job, step: Step) -> bool:
        return job.params.stop_on_eos and step.token_id in self.lm.eos_token_ids


def fingerprint(lm: LM) -> str:
    """OpenAI's system_fingerprint for this model: lmtrace's version and the first 12 hex digits of
    the SHA-256 of its record (source, architecture, dtype, device)."""
    record = json.dumps(lm.record(), sort_keys=True, default=str).encode()
    return f"lmtrace-{__version__}-{hashlib.sha256(record).hexdigest()[:12]}"


def work(lm: LM, job: Job, draft: Any = None, draft_tokens: int = 4) -> Work:
    """The one-request-at-a-time worker's work (`max_batch` 1; with a draft, speculative and one
    row at a time whatever the worker). Events: ("prompt", i,
    [PromptToken]) for echo of prompt i, ("step", choice, Step) per token, ("done", [Trace]) at
    the end (one Trace per choice, choice i * n + j being prompt i's j-th)."""

    if rowwise(job):
        return _rows_work(lm, job, draft, draft_tokens)

    def run(emit: Emit, check) -> None:
        echo_alone(lm, job, emit)
        if not job.generate:
            emit(("done", []))
            return
        traces = []
        for i, p in enumerate(job.prompts):

            def on_step(row: int, step: Step, first: int = i * job.n) -> None:
                check()  # raises Cancelled when the client has gone: the generation stops here
                emit(("step", first + row, step))

            x = {k: v for k, v in job.inside.items() if k != "named_observers"}
            x["observers"] = list(x.get("observers", ())) + [make() for make in job.inside.get("named_observers", ())]
            traces += generate_ids(
                lm, [p.ids] * job.n, job.params, prompt_texts=[p.text] * job.n, chat=job.chat, on_step=on_step,
                **x, **({"draft": draft, "draft_tokens": draft_tokens} if draft is not None else {}),
            )  # fmt: skip
        emit(("done", traces))

    return run


def rowwise(job: Job) -> bool:
    """A trace request with echo, a waterfall, the attribution or processors: each row decoded as
    the batching worker's rows are (lmtrace.decode.continuous), here one at a time."""
    keys = ("echo", "waterfall", "attribution", "logits_processors")
    return any(job.inside.get(k) not in (None, False, ()) for k in keys)


def _rows_work(lm: LM, job: Job, draft: Any, draft_tokens: int) -> Work:
    """`work` for a `rowwise` job: its prompts decoded one after another as rows of their own."""

    def run(emit: Emit, check) -> None:
        def on_step(i: int):
            def hook(step: Step) -> None:
                check()  # raises Cancelled when the client has gone: the generation stops here
                emit(("step", i, step))

            return hook

        drafted = {"draft": draft, "draft_tokens": draft_tokens} if draft is not None else {}
        specs = [
            RowSpec(p.ids, job.params, p.text, job.chat, on_step(i), **row_options(lm, job), **drafted)
            for i, p in enumerate(job.prompts)
        ]
        emit(("done", generate_rows(lm, specs, max_batch=1)))

    return run


def check_rows(job: Job, limit: int) -> None:
    """A request of more rows (prompts times `n`) than the server takes is a 400."""
    if job.choices > limit:
        name = "n" if job.n > 1 else "prompt"
        raise bad_request(
            f"{name}: the request asks for {job.choices} rows ({len(job.prompts)} prompts times n {job.n}); "
            f"this server takes at most {limit} per request (lmtrace serve --max-rows-per-request)",
            name,
        )


def start(state: ServerState, job: Job) -> Handle:
    check_rows(job, state.max_rows)
    # a drafted row of the batch records its lens, attention and attribution (decode/drafted.py)
    drafted = check_draft(state, job.draft_tokens, {})
    job.draft, job.draft_tokens = drafted.get("draft"), drafted.get("draft_tokens")
    if job.compile:  # alone, between the batch's steps (or as the one-at-a-time worker's work)
        compiled.check(state.compile, state.lm, job)
        return _submit(state, compiled.work(state.lm, job, job.draft, job.draft_tokens or state.draft_tokens))
    if isinstance(state.worker, BatchingWorker):  # every request inside the continuous batch
        try:
            return state.worker.submit_job(job)
        except Busy as e:
            raise _busy(e) from e
    # one request at a time (max_batch 1); with a draft, speculative and row by row
    return _submit(state, work(state.lm, job, job.draft, job.draft_tokens or state.draft_tokens))


def check_draft(state: ServerState, draft_tokens: int | None, inside: dict) -> dict:
    """draft_tokens needs a server with a draft (0: without it); the server's draft and the lens,
    attention or attribution `inside` names do not combine (a drafted branch's: /v1/branch; its
    draft_tokens 0 decodes it without the draft). Returns the request's draft as keyword arguments
    ({draft, draft_tokens}; {}: none)."""
    if state.draft is None:
        if draft_tokens is not None:
            got = draft_tokens
            message = f"draft_tokens: this server runs no draft model (lmtrace serve --draft SPEC), got {got}"
            raise APIError(400, message, param="draft_tokens")
        return {}
    if draft_tokens == 0:
        return {}
    asked = [name for name in ("lens", "attention", "attribution") if inside.get(name)]
    if asked:
        message = (f"{asked[0]}: cannot be combined with this server's draft (lmtrace serve --draft); "
                   "send draft_tokens 0 to decode this request without it")  # fmt: skip
        raise APIError(400, message, param=asked[0])
    return {"draft": state.draft, "draft_tokens": draft_tokens or state.draft_tokens}


def _submit(state: ServerState, run: Work) -> Handle:
    try:
        return state.worker.submit(run)
    except Busy as e:
        raise _busy(e) from e


def _busy(e: Busy) -> APIError:
    return APIError(
        429,
        f"{e}; retry after {e.retry_after} s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(e.retry_after)},
    )


@dataclass
class Answer:
    """A whole answer: {prompt index: its echoed tokens}, a Trace per choice, and {prompt
    index: how many of its tokens came from the prefix cache}."""

    prompt: dict[int, list[PromptToken]]
    traces: list[Trace]
    cached: dict[int, int]


async def collect(handle: Handle, request: Request) -> Answer:
    """Waits for the whole answer; cancels the work if the client goes away meanwhile."""
    prompt: dict[int, list[PromptToken]] = {}
    cached: dict[int, int] = {}
    traces = None
    try:
        async for event in handle.events(request):
            if event[0] == "prompt":
                prompt[event[1]] = event[2]
            elif event[0] == "cached":
                cached[event[1]] = event[2]
            elif event[0] == "done":
                traces = event[1]
    except ShuttingDown as e:  # an answer (503), not a failure to log with its traceback
        raise failure(e) from None
    finally:
        if traces is None:
            handle.cancel()
    if traces is None:  # the client left; nobody reads this answer
        raise APIError(499, "client closed the request", code="client_closed_request")
    return Answer(prompt, traces, cached)


@dataclass
class Part:
    """A piece of a streamed answer for one choice: text to send, the tokens that text
    releases, and at the end the finish reason."""

    choice: int
    text: str
    steps: list[tuple[Step, str]] = field(default_factory=list)
    prompt: list[PromptToken] | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None  # only on the last Part, whose choice is -1
    trace: Trace | None = None  # on the Part that finishes its choice: the choice's whole trace


async def stream_parts(state: ServerState, job: Job, handle: Handle, request: Request) -> AsyncIterator[Part]:
    """The answer as Parts, holding back text (and its tokens) until it is final; ends with
    one Part per choice carrying its finish reason, then one carrying the usage."""
    streams = [ChoiceStream(job.params.stop) for _ in range(job.choices)]
    cached: dict[int, int] = {}
    async for event in handle.events(request):
        if event[0] == "cached":
            cached[event[1]] = event[2]
        elif event[0] == "prompt":
            _, p, tokens = event
            for i in range(p * job.n, (p + 1) * job.n):
                yield Part(i, job.prompts[p].text, prompt=tokens)
        elif event[0] == "step":
            _, i, step = event
            text, ready = streams[i].add(step, state.is_eos(job, step))
            if text or (ready and job.logprobs):
                yield Part(i, text, ready)
        elif event[0] == "done":
            traces = event[1] or [None] * job.choices  # echo with max_tokens 0 generates nothing
            for i, trace in enumerate(traces):
                text, ready = streams[i].finish(trace.text) if trace else ("", [])
                finish = trace.finish_reason if trace else finish_reason(False, False, True, openai=True)
                yield Part(i, text, ready, finish_reason=finish, trace=trace)
            yield Part(-1, "", usage=usage(job, event[1], cached))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(job: Job, traces: list[Trace], cached: dict[int, int] | None = None) -> dict[str, Any]:
    """Tokens of every prompt (each counted once, whatever `n`) and of every choice; where the
    prefix cache served some prompt tokens, how many (OpenAI's prompt_tokens_details)."""
    prompt = sum(len(p.ids) for p in job.prompts)
    completion = sum(len(t.steps) for t in traces)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    out["total_tokens"] = prompt + completion
    hit = sum((cached or {}).values())
    if hit:
        out["prompt_tokens_details"] = {"cached_tokens": hit}
    return out


async def openai_chunks(
    state: ServerState,
    job: Job,
    handle: Handle,
    request: Request,
    head: dict[str, Any],
    with_usage: bool,
    render: Callable[[Part], Iterator[dict[str, Any]]],
) -> AsyncIterator[str]:
    """The server-sent events of a streamed OpenAI answer: `render(part)` gives each part's
    chunks; a last chunk with `usage` when asked; an error as the last event once the stream has
    started; then `data: [DONE]`."""
    try:
        async for part in stream_parts(state, job, handle, request):
            if part.usage is not None:
                if with_usage:
                    yield sse({**head, "choices": [], "usage": part.usage})
                continue
            for chunk in render(part):
                yield sse(chunk)
    except Exception as e:  # the stream has started: the error goes in an event
        yield sse(failure(e).body())
    yield DONE
