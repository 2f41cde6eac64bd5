"""A batch line that asks for `compile`: decoded on its own by the library's compiled path, exactly
as `lmtrace.generate(..., compile=True)` decodes it (decode/static.py: a static cache whose shapes
are one row's), beside the continuous batch of the other lines, whose rows join and leave and
change the forward's shapes every step. Its record is generate's, with the line's other options."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmtrace.batch.prepare import Job
from lmtrace.decode import tracing
from lmtrace.decode.options import GenerateOptions
from lmtrace.logits import named
from lmtrace.model.draft import draft_for
from lmtrace.model.lm import LM
from lmtrace.records import Step, Trace


def options_of(lm: LM, job: Job, known: dict[str, Any]) -> GenerateOptions:
    """The line's options as generate's (`known`: the command's processors, by name)."""
    x, drafted = job.extras, {}
    if job.draft is not None:  # loaded once, kept on the model
        drafted = {"draft": draft_for(lm, job.draft["draft"]), "draft_tokens": job.draft["draft_tokens"]}
    return GenerateOptions(
        job.params,
        chat=job.chat,
        echo=x.echo,
        waterfall=x.waterfall,
        compile=True,
        lens=bool(job.inside.get("lens")),
        attention=job.inside.get("attention", False),
        logits_processors=named.resolve(list(x.logits_processors), known),
        uncertainty=job.uncertainty,
        attribution=x.attribution,
        against=x.against,
        **drafted,
    )


def decode_alone(lm: LM, job: Job, on_step: Callable[[Step], None] | None, known: dict[str, Any]) -> Trace:
    """The line's trace, decoded alone with the compiled step; `on_step(step)` as each comes."""
    hook = None if on_step is None else (lambda _row, step: on_step(step))
    return tracing.run(lm, options_of(lm, job, known), [job.text], [job.ids], hook)[0]
