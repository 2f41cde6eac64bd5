"""A request that asks for `compile` (completions, chat, /v1/traces), on a server started with
--compile (`create_app(compile=True)`: compiling takes tens of seconds on a CPU the first time a
sampling setting is seen, and would hold up every other client, so the operator opts in). Each
choice is decoded on its own by the library's compiled path, exactly as `lmtrace.generate(...,
compile=True)` decodes it: the static cache is one row's, which a continuous batch, whose rows join
and leave and change the forward's shapes every step, is not. On the batching worker the request
runs on the model thread between two steps of the batch (as /v1/branch and /v1/score do); on the
one-at-a-time worker as its work. Choice j of a request with `seed` s draws from its own generator
seeded s + j, as in the batch. Numbers within 5e-5 of the default path's (the compiled step's bound)."""

from __future__ import annotations

import dataclasses
from typing import Any

from lmtrace.decode import attribution as attributing
from lmtrace.decode import static, tracing
from lmtrace.decode.options import GenerateOptions
from lmtrace.errors import InvalidParameter
from lmtrace.inside import probe
from lmtrace.model.lm import LM
from lmtrace.records import Step, Trace
from lmtrace.server.errors import APIError, from_invalid
from lmtrace.server.lane import echo_alone
from lmtrace.server.prepare import Job
from lmtrace.server.worker import Emit, Work


def allowed(lm: LM, draft: Any = None) -> bool:
    """True, once the model that compiles is one torch.compile can trace (a one-line
    InvalidParameter naming `compile` otherwise: static.check): the server's draft where it has
    one (its step is the compiled one, as generate(compile=True, draft=...) compiles it, so a
    target on --matmul onednn keeps its kernel), else the model."""
    if draft is not None:
        static.check(draft.model, "draft")
    else:
        static.check(lm.model)
    return True


def check(allowed: bool, lm: LM, job: Job) -> None:
    """A 400 naming `compile` where the server does not let requests compile, or naming both
    options where the request's other options read inside the compiled forward (as generate refuses)."""
    if not allowed:
        message = "compile: this server does not let requests compile (start it with lmtrace serve --compile)"
        raise APIError(400, message, param="compile")
    if job.draft is None:  # draft_tokens 0 on a server whose draft is what compiles (allowed: its draft only)
        try:
            static.check(lm.model)
        except InvalidParameter as e:
            message = f"{e}; only this server's draft compiles: not with draft_tokens 0"
            raise APIError(400, message, param="compile") from e
    x = job.inside
    try:
        probe.check(True, x.get("lens", False), x.get("attention", False))
        attributing.wanted(lm, bool(x.get("attribution")), None, compile=True)
    except InvalidParameter as e:
        raise from_invalid(e) from e


def work(lm: LM, job: Job, draft: Any = None, draft_tokens: int = 4) -> Work:
    """The request's work (the events of lmtrace.server.generation's `work`): its echo, then each
    choice decoded alone with the compiled step, ("done", [Trace]) at the end."""

    def run(emit: Emit, check_cancelled) -> None:
        echo_alone(lm, job, emit)
        if not job.generate:
            emit(("done", []))
            return
        traces = [
            _choice(lm, job, choice, (draft, draft_tokens), emit, check_cancelled) for choice in range(job.choices)
        ]
        emit(("done", traces))

    return run


def _choice(lm: LM, job: Job, choice: int, drafted: tuple[Any, int], emit: Emit, check_cancelled) -> Trace:
    """One choice, as generate(compile=True) decodes it; its steps sent as they come."""
    params, j = job.params, choice % job.n
    if params.seed is not None and j:
        params = dataclasses.replace(params, seed=(params.seed + j) % 2**64)
    draft = {"draft": drafted[0], "draft_tokens": drafted[1]} if drafted[0] is not None else {}
    x = {k: v for k, v in job.inside.items() if k != "named_observers"}
    own = list(x.pop("observers", ())) + [make() for make in job.inside.get("named_observers", ())]
    options = GenerateOptions(params, chat=job.chat, compile=True, observers=own, **x, **draft)

    def on_step(_row: int, step: Step) -> None:
        check_cancelled()  # raises Cancelled when the client has gone: the generation stops here
        emit(("step", choice, step))

    p = job.prompt_of(choice)
    return tracing.run(lm, options, [p.text], [p.ids], on_step)[0]
