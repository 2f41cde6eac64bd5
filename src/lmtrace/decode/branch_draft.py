"""Branching with a draft model (`lmtrace branch --draft`): the original decodes speculatively;
each branch takes the original's steps before `at`, forces the alternative at `at` under the
raw distribution the original had there (kept by an observer, with the penalty mask and the
random stream after the original's draw), and continues speculatively from there. The numbers
are the target's, as in decode/branch.py's plain branches; each branch has its own caches."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.decode import engine, speculative
from lmtrace.decode.loop import Finish, Watch, advance
from lmtrace.decode.observers import Observer
from lmtrace.decode.rows import RowRecord, records, to_trace
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger
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


@dataclass
class _Run:
    """What every drafted branch shares: the model, the prompt (text and ids), the plan (its params,
    its draft and draft_tokens, chat)."""

    lm: LM
    prompt: str
    ids: list[int]
    plan: Any

    @property
    def params(self) -> SamplingParams:
        return self.plan.params


def branches(
    lm: LM, prompt: str, ids: list[int], at: int, ranked: tuple[list[int], bool], plan: Any
) -> tuple[list[Trace], list[int]]:
    """(the original and one trace per branch, the ranks branched on), decoded with `plan`'s draft
    (decode/options.py Plan); `ranked`: the ranks asked for, and whether they are a fan."""
    run, (ranks, fan), p = _Run(lm, prompt, ids, plan), ranked, plan.params
    fork = Fork(at)
    row = RowRecord(lm, p.stop)
    tallies = [tally for _, _, tally in speculative.iter_rows(lm, plan, [ids], [row], [fork])]
    original = to_trace(lm, prompt, ids, p, row, plan.options.chat)
    original.speculative = tallies[-1].to_dict() if tallies else None
    if fork.logits is None:
        raise InvalidParameter(f"at must be a step the decoding reached (0..{len(original.steps) - 1}), got {at}")
    order = torch.topk(fork.logits[0], max(ranks)).indices.tolist()
    if fan:  # the original's own token is the original, not a branch
        ranks = [r for r in ranks if order[r - 1] != original.steps[at].token_id]
    traces = [original]
    for rank in ranks:
        traces.append(_branch(run, original, fork, order[rank - 1]))
    return traces, ranks


def _branch(run: _Run, original: Trace, fork: Fork, token: int) -> Trace:
    lm, p, at, draft, k = run.lm, run.params, fork.at, run.plan.draft, run.plan.options.draft_tokens
    row = RowRecord(lm, p.stop)
    for s in original.steps[:at]:  # replays the detokenizer; the original stopped at none of these
        row.add(s.token_id, False)
    row.steps = [dataclasses.replace(s) for s in original.steps[:at]]
    eos = set(lm.eos_token_ids) if p.stop_on_eos else set()
    hook = lambda r, t: row.add(t, t in eos)  # noqa: E731
    tally = speculative.Tally(draft.spec, k, draft.describe())
    for _ in records(lm, [run.ids], _steps(run, original, fork, token, (hook, tally)), [row]):
        pass
    trace = to_trace(lm, run.prompt, run.ids, p, row, run.plan.options.chat)
    trace.speculative = tally.to_dict()
    return trace


def _steps(
    run: _Run, original: Trace, fork: Fork, token: int, counted: tuple[Any, speculative.Tally]
) -> Iterator[BatchStep]:
    """The forced step at `at`, then the speculative continuation (steps numbered on from it);
    `counted`: the hook that sees each token and the branch's Tally."""
    lm, p, (hook, tally) = run.lm, run.params, counted
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
    prefix = run.ids + [s.token_id for s in original.steps[:at]] + [token]
    rest = dataclasses.replace(p, max_new_tokens=p.max_new_tokens - at - 1)
    setup = engine.Setup(eos, lm.pad_token_id, hook)
    drafting = speculative.Drafting(run.plan.draft.model, run.plan.options.draft_tokens, tally)
    for step in speculative.generate_steps(lm.model, prefix, rest, rng, setup, drafting):
        step.index += at + 1
        yield step
