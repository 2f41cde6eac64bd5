"""The one decoding loop, `drive`, over sources of logits, and what it does at each step, written
once (`advance`): the step itself (decode/step.py `take`: the grammar mask, the processors, the
choice, the numbers), a constrained row whose grammar allowed nothing, the observers
(decode/observers.py) on the rows that asked for them, and the finish reasons.

A source (`Source`) is what differs between loops: it gives each step's input (`Fed`: the step's
index, the raw logits, how the rows choose, which rows are active, the cache's state, what is
recorded beside the numbers), sees the chosen tokens and their step before the step is yielded
(`chose`: a fork saved, a block's crop) and takes them back after (`took`: the next forward, a
draft's next block, a branch's forced prefix; it says when it is done by giving no next step).
The static batch (engine.py), a branch (branch.py, its forced step in branch_draft.py, a one-step
`Once`), a speculative block (speculative.py: the draft's proposal judged in the step) and a
continuous batch's step (continuous.py) are sources; `advance` is called here and nowhere else,
and nothing else calls `take`. Two modes of the same loop: a step whose numbers were measured
elsewhere (`Fed.measured`: the compiled step, decode/static_loop.py, measures in its graph a step
ahead and is recorded through `recorded`), and a step measured beside the next forward
(`Fed.beside`: continuous batching's `overlap`; the tokens picked, `settle` on that thread while
the source's `took` runs the forward).

    how = choosing(Rows([params], rng, prompts), model)        # decode/choosing.py
    watch = Watch(observers, finish=Finish(eos_token_ids, params, on_token))
    for tokens, step in drive(source): ...                       # source.next() -> Fed(..., how, ..., watch)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import torch

from lmtrace.decode import step as one_step
from lmtrace.decode.observers import Observer
from lmtrace.decode.step import BatchStep, Choosing, TokenHook
from lmtrace.kv import ledger
from lmtrace.params import SamplingParams


@dataclass
class Finish:
    """How the step's finish reasons are set: the end tokens, the params (max_new_tokens, whether
    an end token stops), the hook that sees each token (stop strings)."""

    eos_token_ids: Sequence[int]
    params: SamplingParams
    on_token: TokenHook | None = None


@dataclass
class Watch:
    """What the step records and decides beside its numbers: the observers (run over the batch;
    with `wanted`, one list per row, a row keeps only the entries of the observers it asked for),
    the finish rule (None: the caller sets the finish reasons itself, as continuous batching's rows
    do), each row's own step number where rows are at different steps (`indices`). A constrained
    row whose grammar allowed no token raises its InvalidParameter; with `failed` (a dict) it is
    put there instead, {row: error}, and the other rows go on (a batch of requests)."""

    observers: Sequence[Observer] = ()
    wanted: Sequence[Sequence[Observer]] | None = None
    finish: Finish | None = None
    indices: Sequence[int] | None = None
    failed: dict[int, Exception] | None = None


@dataclass
class Fed:
    """One step's input from its source: its index, the raw logits (batch, vocab) float32, how the
    rows choose, which rows are active, the cache's state, what is recorded beside the numbers.
    `measured`: the step's numbers measured elsewhere (the compiled step: measure.chosen's floats
    and ints; `logits` unused), recorded without a choice here. `beside`: the step measured on
    that executor's thread while the source's `took` runs (continuous batching's `overlap`)."""

    index: int
    logits: torch.Tensor | None
    how: Choosing
    active: Sequence[bool]
    kv: ledger.KVState
    watch: Watch
    measured: tuple[list, list] | None = None
    beside: Executor | None = None


class Source(Protocol):
    """Where the loop's steps come from: `next()` the next step's input (None: done), `chose`
    the chosen tokens (batch,) and their step before it is yielded, `took` them after it (the
    next forward). In the `beside` mode `chose` runs on the measuring thread and `took` (with no
    step yet) beside it."""

    def next(self) -> Fed | None: ...

    def chose(self, tokens: torch.Tensor, step: BatchStep) -> None: ...

    def took(self, tokens: torch.Tensor, step: BatchStep | None) -> None: ...


class Once:
    """A source of one step, fed as given, with nothing after it: a branch's forced step, the
    first steps chosen from prefills."""

    def __init__(self, fed: Fed):
        self.fed: Fed | None = fed

    def next(self) -> Fed | None:
        fed, self.fed = self.fed, None
        return fed

    def chose(self, tokens: torch.Tensor, step: BatchStep) -> None:
        pass

    def took(self, tokens: torch.Tensor, step: BatchStep | None) -> None:
        pass


def drive(source: Source, started: float | None = None) -> Iterator[tuple[torch.Tensor, BatchStep]]:
    """The decoding loop: each step of `source` chosen and measured (`advance`; a measured one
    recorded), its time set (from `started`, or the loop's start, to the step; then from the
    step's yield on), handed to the source (`chose`), yielded, marked seen (where it was chosen
    here) and handed back (`took`), until the source gives no next step. The step, `chose` and the
    marking run under torch.inference_mode; `took` (the forward) in the caller's mode."""
    started = time.perf_counter() if started is None else started
    while (fed := source.next()) is not None:
        if fed.beside is not None:
            tokens, step = _beside(fed, source, started)
            yield tokens, step
            started = time.perf_counter()
            continue
        with torch.inference_mode():
            if fed.measured is not None:
                step = recorded(fed.index, *fed.measured, fed.how, fed.active, fed.kv, fed.watch)
                tokens = torch.tensor(step.token_ids)
            else:
                tokens, step = advance(fed.index, fed.logits, fed.how, fed.active, fed.kv, fed.watch)
            step.time_ms = (time.perf_counter() - started) * 1000
            source.chose(tokens, step)
        yield tokens, step
        started = time.perf_counter()
        if fed.measured is None:
            with torch.inference_mode():
                fed.how.saw(tokens)
        source.took(tokens, step)


def _beside(fed: Fed, source: Source, started: float) -> tuple[torch.Tensor, BatchStep]:
    """A step in two halves: the tokens picked (and marked seen) now; the step measured and handed
    to the source's `chose` on `fed.beside`'s thread while its `took` starts the next forward
    from the tokens; the step once both are done."""
    with torch.inference_mode():
        picked = one_step.pick(fed.logits, fed.how, fed.active)
        fed.how.saw(picked.tokens)

    def measure() -> BatchStep:
        with torch.inference_mode():  # the thread's own: the mode is per thread
            step = settle(fed.index, fed.logits, picked, fed.how, fed.active, fed.kv, fed.watch)
        step.time_ms = (time.perf_counter() - started) * 1000
        source.chose(picked.tokens, step)
        return step

    # torch's kernels let go of the interpreter: the two threads run together
    measuring = fed.beside.submit(measure)
    try:
        source.took(picked.tokens, None)
    finally:
        step = measuring.result()
    return picked.tokens, step


def advance(
    index: int, logits: torch.Tensor, how: Choosing, active: Sequence[bool], kv: ledger.KVState, watch: Watch
) -> tuple[torch.Tensor, BatchStep]:
    """One step of every row: the tokens (batch,) and the BatchStep with the observers' entries
    and (with a finish rule) the finish reasons. `drive`'s, the only caller."""
    tokens, step = one_step.take(index, logits, how, active, kv)
    _watched(step, logits, tokens, how, watch)
    return tokens, step


def settle(
    index: int, logits: torch.Tensor, picked: one_step.Picked, how: Choosing, active: Sequence[bool],
    kv: ledger.KVState, watch: Watch,
) -> BatchStep:  # fmt: skip
    """`advance` after its choice (`one_step.pick`): the BatchStep of the picked tokens. A loop
    that starts the next forward from the picked tokens runs this beside it."""
    step = one_step.measured(index, logits, picked, how, active, kv)
    _watched(step, logits, picked.tokens, how, watch)
    return step


def recorded(
    index: int, floats: list, ints: list, how: Choosing, active: Sequence[bool], kv: ledger.KVState, watch: Watch
) -> BatchStep:
    """The BatchStep of numbers measured elsewhere (the compiled step, decode/static.py, with
    lmtrace.logits.measure's rule: `floats`, `ints` as measure.chosen's rows), with the finish
    reasons. The compiled step has no grammar, observers or per-row params (static.whole_step)."""
    step = one_step.assemble(index, floats, ints, list(active), how.top_n, kv)
    _watched(step, torch.empty(0), torch.tensor(step.token_ids), how, watch)
    return step


def _watched(step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing, watch: Watch) -> None:
    """A grammar that allowed nothing, the observers' entries, the finish reasons."""
    failed = one_step.nothing_allowed(step, how, watch.indices)
    if watch.failed is None:
        for error in failed.values():
            raise error
    else:
        watch.failed.update(failed)
    if watch.wanted is None:
        for observer in watch.observers:
            entry = observer.observe(step, logits, tokens, how)
            if entry is not None:
                step.entries[observer.name] = entry
    else:
        _observe_rows(step, logits, tokens, how, watch)
    if watch.finish is not None:
        f = watch.finish
        one_step.finish(step, f.eos_token_ids, f.params, f.on_token)


def _observe_rows(step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing, watch: Watch) -> None:
    """Each observer some row asked for, run over the batch (`observe_rows`: told which rows asked
    and each row's own step number); only the asking rows keep its entry."""
    wanted = watch.wanted or ()
    indices = watch.indices if watch.indices is not None else [step.index] * len(wanted)
    chosen: dict[int, Observer] = {}
    for own in wanted:
        for o in own:
            chosen[id(o)] = o
    for o in chosen.values():
        rows = [r for r, own in enumerate(wanted) if any(x is o for x in own)]
        entries = o.observe_rows(step, logits, tokens, how, rows, indices)
        if entries is None:
            continue
        # rows may ask for observers of one name through instances of their own (two requests
        # with uncertainty): each row keeps the entry of its own instance
        kept = step.entries.setdefault(o.name, [None] * len(wanted))
        for r, (e, own) in enumerate(zip(entries, wanted)):
            if any(x is o for x in own):
                kept[r] = e
