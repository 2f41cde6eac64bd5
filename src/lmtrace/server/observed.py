"""The observers on the OpenAI routes (an lmtrace extension): completions and chat take the
fields /v1/traces takes for what each step records beside its logprobs (`lens`, `attention`,
`uncertainty`: schemas.Observing), decode them in the same batch as a trace, and answer each
step's entries as the trace's step has them, in an object `observed` beside the token's logprobs:
`choices[].logprobs.content[].observed` (chat), `choices[].logprobs.observed[]` (completions, one
per token, null for an echoed prompt token), and the trace's own entries (uncertainty's sequence
scores) as `choices[].observed`.

Which entries: whatever the step record holds from its observers (Step.entries, and the fields
the built-in ones write), so an observer added to the decoding reaches these routes with no edit
here."""

from __future__ import annotations

from typing import Any

from lmtrace.model.lm import LM
from lmtrace.records import Step, Trace
from lmtrace.registered import Registered
from lmtrace.server.errors import bad_request
from lmtrace.server.prepare import Job, recorded
from lmtrace.server.schemas import Observing

NAME = "observed"
# the Step fields the built-in observers write (the others write Step.entries)
FIELDS = ("waterfall", "lens", "attention")


def inside(lm: LM, body: Observing, params: Any, known: Registered) -> dict[str, Any]:
    """The request's observer fields as the decoding's keyword arguments (Job.inside): lens and
    attention as they are, uncertainty as an Observer, the waterfall, attribution and processors
    (names the server registered) as /v1/traces takes them (prepare.recorded; an OpenAI route's
    `echo` is its own: the prompt before the completion)."""
    out: dict[str, Any] = {"lens": body.lens, "attention": body.attention}
    if body.uncertainty:  # an observer: the engine's own batch, as lens and attention
        from lmtrace.decode.uncertainty import Uncertainty

        out["observers"] = [Uncertainty(vocab=lm.model.config.vocab_size)]
    out.update({k: v for k, v in recorded(lm, body, params, known).items() if k != "echo"})
    return out


# the fields that record beside each token (the others, the processors, change the decoding)
RECORDING = ("lens", "attention", "uncertainty", "waterfall", "attribution", "against", "observers")
# the job's entries whose observers write the answer's `observed`
WRITING = ("lens", "attention", "observers", "waterfall", "attribution", "named_observers")


def asked(body: Observing) -> list[str]:
    """The recording fields the request set."""
    return [name for name in RECORDING if getattr(body, name) not in (None, False)]


def observe(lm: LM, job: Job, body: Observing, logprobs_name: str, known: Registered) -> Job:
    """The job with the request's observers; they need the answer's logprobs, which carry their
    entries (a 400 naming both otherwise). `known`: the processors and observers the server registered."""
    wanted = asked(body)
    if wanted and not job.logprobs:
        message = f"{wanted[0]} needs {logprobs_name}: its entries go beside each token's logprobs"
        raise bad_request(message, wanted[0])
    job.inside = inside(lm, body, job.params, known) if wanted or body.logits_processors else {}
    return job


def observing(job: Job) -> bool:
    """Whether the answer carries the observers' entries."""
    return any(bool(job.inside.get(name)) for name in WRITING)


def step_entries(step: Step) -> dict[str, Any]:
    """The step's observer entries, as its JSON in a trace writes them."""
    d = step.to_dict()
    return {name: d[name] for name in (*FIELDS, *step.entries) if name in d}


def trace_entries(trace: Trace | None) -> dict[str, Any]:
    """The trace's own observer entries (uncertainty's sequence scores), as its JSON writes them."""
    return {} if trace is None else dict(trace.entries)
