"""Branching with a draft model (`lmtrace branch --draft`): the original decodes speculatively;
each branch takes the original's steps before `at`, forces the alternative at `at` under the
raw distribution the original had there (kept by an observer, with the penalty mask and the
random stream after the original's draw), and continues speculatively from there. The numbers
are the target's, as in decode/branch.py's plain branches; each branch has its own caches."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from lmtrace.decode import engine, speculative
from lmtrace.decode.loop import Finish, Watch, advance
from lmtrace.decode.observers import Observer
from lmtrace.decode.rows import RowRecord, records, to_trace
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger
from lmtrace.model.draft import Draft
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Trace


class Fork(Observer):
    """An observer that keeps step `at`'s raw logits (1, vocab), its penalty mask before the
    step's token and the random stream after its draw."""

    all_positions = False

    def __init__(self, at: int):
        self.at = at
        self.logits: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.rng_state: torch.Tensor | None = None

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        pass

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> None:
        if step.index == self.at:
            seen = how.batch_seen()
            self.logits, self.seen = logits.clone(), None if seen is None else seen.clone()
            self.rng_state = None if how.rng is None else how.rng.get_state()


def branches(
    lm: LM, ids: list[int], prompt: str, at: int, ranks: list[int], fan: bool, p: SamplingParams, chat: bool,
    draft: Draft, k: int,
) -> tuple[list[Trace], list[int]]:  # fmt: skip
    """(the original and one trace per branch, the ranks branched on)."""
    fork = Fork(at)
    row = RowRecord(lm, p.stop)
    tallies = [tally for _, _, tally in speculative.iter_rows(lm, draft, [ids], p, [row], k, [fork])]
    original = to_trace(lm, prompt, ids, p, row, chat)
    original.speculative = tallies[-1].to_dict() if tallies else None
    if fork.logits is None:
        raise InvalidParameter(f"at must be a step the decoding reached (0..{len(original.steps) - 1}), got {at}")
    order = torch.topk(fork.logits[0], max(ranks)).indices.tolist()
    if fan:  # the original's own token is the original, not a branch
        ranks = [r for r in ranks if order[r - 1] != original.steps[at].token_id]
    traces = [original]
    for rank in ranks:
        traces.append(_branch(lm, ids, prompt, original, fork, order[rank - 1], p, chat, draft, k))
    return traces, ranks


def _branch(
    lm: LM, ids: list[int], prompt: str, original: Trace, fork: Fork, token: int, p: SamplingParams, chat: bool,
    draft: Draft, k: int,
) -> Trace:  # fmt: skip
    at = fork.at
    row = RowRecord(lm, p.stop)
    for s in original.steps[:at]:  # replays the detokenizer; the original stopped at none of these
        row.add(s.token_id, False)
    row.steps = [dataclasses.replace(s) for s in original.steps[:at]]
    eos = set(lm.eos_token_ids) if p.stop_on_eos else set()
    hook = lambda r, t: row.add(t, t in eos)  # noqa: E731
    tally = speculative.Tally(draft.spec, k, draft.describe())
    for _ in records(lm, [ids], _steps(lm, ids, original, fork, token, p, draft, k, hook, tally), [row]):
        pass
    trace = to_trace(lm, prompt, ids, p, row, chat)
    trace.speculative = tally.to_dict()
    return trace


def _steps(
    lm: LM, ids: list[int], original: Trace, fork: Fork, token: int, p: SamplingParams, draft: Draft, k: int,
    hook: Any, tally: speculative.Tally,
) -> Iterator[BatchStep]:  # fmt: skip
    """The forced step at `at`, then the speculative continuation (steps numbered on from it)."""
    at, rng = fork.at, None
    if fork.rng_state is not None:
        rng = torch.Generator(device=lm.model.device)
        rng.set_state(fork.rng_state)
    seen = None if fork.seen is None else fork.seen.clone()
    how = Choosing([p], rng, seen, forced=torch.tensor([token], device=fork.logits.device))
    kv = ledger.KVState(**{k: v for k, v in original.steps[at].kv.items() if k in ledger.KVState.__dataclass_fields__})
    eos = sorted(lm.eos_token_ids) if p.stop_on_eos else []
    tokens, step = advance(at, fork.logits, how, [True], kv, Watch(finish=Finish(eos, p, hook)))
    step.draft = [None]  # the forced token: no proposal
    yield step
    if step.finish[0] is not None:
        return
    prefix = ids + [s.token_id for s in original.steps[:at]] + [token]
    rest = dataclasses.replace(p, max_new_tokens=p.max_new_tokens - at - 1)
    setup = engine.Setup(eos, lm.pad_token_id, hook)
    for step in speculative.generate_steps(lm.model, draft.model, prefix, rest, rng, setup, k, tally):
        step.index += at + 1
        yield step
