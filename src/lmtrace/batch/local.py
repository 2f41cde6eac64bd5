"""The local engine: lines into batches of similar length, each batch decoded together (each
line with its own settings: lmtrace.decode.continuous), one output line per input line. The Ray
engine runs the same function inside each worker."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from lmtrace.batch import compiled
from lmtrace.batch.lines import InputLine
from lmtrace.batch.output import record_line
from lmtrace.batch.prepare import Job, prepare
from lmtrace.decode import attribution as attributing
from lmtrace.decode import named_observers
from lmtrace.decode.continuous import RowSpec, generate_rows
from lmtrace.decode.observers import build
from lmtrace.logits import named
from lmtrace.model.draft import draft_for
from lmtrace.model.lm import LM
from lmtrace.registered import Registered

# lines tokenized and sorted together: longer windows pad less, shorter ones write sooner
WINDOW_BATCHES = 64


@dataclass
class Outcome:
    """One output line, ready to append: the id's key, the JSON text, tokens generated."""

    key: str
    line: str
    tokens: int = 0
    error: bool = False


def error_outcome(line: InputLine, message: str) -> Outcome:
    return Outcome(line.key, record_line(line.id, error=message), error=True)


def batches(jobs: Sequence[Job], batch_size: int) -> Iterator[list[Job]]:
    """Jobs in batches of similar prompt length, whatever their settings (each row decodes
    with its own), longest first: a batch that does not fit in memory fails at the start."""
    ordered = sorted(jobs, key=lambda j: (-len(j.ids), j.line.number))
    for start in range(0, len(ordered), batch_size):
        yield ordered[start : start + batch_size]


def _decode(lm: LM, batch: list[Job], on_step: Callable[[int, Any], None] | None, known: Registered) -> list[Outcome]:
    """Every line of the batch a row of one continuous batch (lmtrace.decode.continuous), each with
    its own settings: plain, with the lens or the attention, with a draft, with echo, the waterfall,
    the attribution or the command's processors (`known`, by name); a line with `compile` decoded
    alone with the compiled step (batch/compiled.py)."""
    hooks = [None if on_step is None else _row_hook(on_step, r) for r in range(len(batch))]
    rows = [(j, hook) for j, hook in zip(batch, hooks) if not j.compile]
    specs = [RowSpec(j.ids, j.params, j.text, j.chat, hook, **_asked(lm, j, known)) for j, hook in rows]
    found = dict(zip((id(j) for j, _ in rows), generate_rows(lm, specs, max_batch=len(specs)) if specs else []))
    for job, hook in zip(batch, hooks):
        if job.compile:
            found[id(job)] = compiled.decode_alone(lm, job, hook, known)
    traces = [found[id(j)] for j in batch]
    outcomes = []
    for job, trace in zip(batch, traces):
        if job.messages is not None:
            trace.prompt["messages"] = job.messages
        try:
            outcomes.append(Outcome(job.line.key, record_line(job.line.id, trace.to_dict()), len(trace.steps)))
        except ValueError as e:  # a number JSON cannot hold (NaN)
            outcomes.append(error_outcome(job.line, f"cannot write the trace as JSON ({e})"))
    return outcomes


def _asked(lm: LM, job: Job, known: Registered) -> dict[str, Any]:
    """The line's lens, attention, draft, uncertainty, echo, waterfall, attribution and processors
    (`known`: the command's, by name) as a row's (the draft loaded once, kept on the model)."""
    out: dict[str, Any] = {k: v for k, v in job.inside.items() if v}
    x = job.extras
    p = job.params
    observers = build(waterfall=x.waterfall, max_new_tokens=p.max_new_tokens, top_n=p.top_logprobs)
    if job.uncertainty:
        from lmtrace.decode.uncertainty import Uncertainty

        observers.append(Uncertainty(vocab=lm.model.config.vocab_size))
    observers += attributing.wanted(lm, x.attribution, x.against)
    if x.echo:
        out["echo"] = True
    observers += named_observers.resolve(list(x.observers), known.observers)  # each row its own
    if observers:
        out["observers"] = observers
    if x.logits_processors:
        out["logits_processors"] = named.resolve(list(x.logits_processors), known.processors)
    if job.draft is not None:
        out.update(draft=draft_for(lm, job.draft["draft"]), draft_tokens=job.draft["draft_tokens"])
    return out


def _row_hook(on_step: Callable[[int, Any], None], row: int) -> Callable[[Any], None]:
    return lambda step: on_step(row, step)


def run_batch(
    lm: LM, batch: list[Job], on_step: Callable[[int, Any], None] | None = None, known: Registered | None = None
) -> list[Outcome]:
    """Decodes a batch; when it fails, each line alone, so that one line's failure is that
    line's error only. `known`: the command's processors and observers by name."""
    try:
        return _decode(lm, batch, on_step, known or Registered())
    except Exception as e:
        if len(batch) > 1:
            return [o for job in batch for o in run_batch(lm, [job], on_step, known)]
        return [error_outcome(batch[0].line, f"{type(e).__name__}: {' '.join(str(e).split())}")]


def trace_lines(
    lm: LM,
    lines: Iterable[InputLine],
    defaults: dict[str, Any],
    batch_size: int,
    on_tokens: Callable[[int], None] | None = None,
) -> Iterator[Outcome]:
    """An Outcome for every line, in the order batches finish. `on_tokens(n)` is called as
    tokens are generated (for a live rate)."""
    on_step = (lambda row, step: on_tokens(1)) if on_tokens is not None else None
    # imported once, before any line (the specs travel in `defaults`, to Ray's workers too)
    known = named_observers.registered_of(defaults.get("logits_processors"), defaults.get("observers"))
    it = iter(lines)
    while window := list(islice(it, batch_size * WINDOW_BATCHES)):
        jobs = []
        for line in window:
            job = prepare(lm, line, defaults)
            if isinstance(job, str):
                yield error_outcome(line, job)
            else:
                jobs.append(job)
        for batch in batches(jobs, batch_size):
            yield from run_batch(lm, batch, on_step, known)


def local_engine(
    load_lm: Callable[[], LM], defaults: dict[str, Any], batch_size: int
) -> Callable[[list[InputLine], Callable[[int], None]], Iterator[Outcome]]:
    """The engine run_job calls: it loads the model (once, when there is work) and traces."""

    def run(pending: list[InputLine], on_tokens: Callable[[int], None]) -> Iterator[Outcome]:
        lm = load_lm()
        return trace_lines(lm, pending, defaults, batch_size, on_tokens)

    return run
