"""What every decoding loop does at each step, written once: the step itself (decode/step.py
`take`: the grammar mask, the processors, the choice, the numbers), a constrained row whose grammar
allowed nothing, the observers (decode/observers.py) on the rows that asked for them, and the finish
reasons. The static batch (engine.py), continuous batching (continuous.py), speculative blocks
(speculative.py), branches (branch.py, branch_draft.py) differ only in what they feed the model
between steps; each calls `advance` (continuous batching may call its two halves, `one_step.pick` and
`settle`, to measure a step while the next forward runs), and nothing else calls `take`; the
compiled step (static_loop.py) measures in its graph and records through `recorded`.

    watch = Watch(observers, finish=Finish(eos_token_ids, params, on_token))
    tokens, step = advance(index, logits, how, active, kv, watch)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def advance(
    index: int, logits: torch.Tensor, how: Choosing, active: Sequence[bool], kv: ledger.KVState, watch: Watch
) -> tuple[torch.Tensor, BatchStep]:
    """One step of every row: the tokens (batch,) and the BatchStep with the observers' entries
    and (with a finish rule) the finish reasons."""
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
