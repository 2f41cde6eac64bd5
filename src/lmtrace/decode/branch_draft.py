"""Branching with a draft model (`lmtrace branch --draft`): the original decodes speculatively
(decode/speculative.py, generate's own run); each branch takes the original's steps before `at`,
forces the alternative at `at` under the raw distribution the original had there (kept by an
observer with the random stream after the original's draw and every observer's captures of the
forward behind it), and goes on speculatively after it (`Speculation.forced`). The penalty's seen
tokens, the user's processors' history and the grammar are the branch's own tokens'; the numbers
are the target's, as in decode/branch.py's plain branches; each branch has its own caches."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lmtrace.decode import constrained, engine, speculative
from lmtrace.decode.choosing import Rows, choosing
from lmtrace.decode.loop import Fed, Finish, Once, Watch, drive
from lmtrace.decode.observers import Observer, attached
from lmtrace.decode.options import Plan
from lmtrace.decode.row_state import RowState, records
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.decode.tracing import traced
from lmtrace.kv import ledger
from lmtrace.logits import grammar
from lmtrace.model.lm import LM
from lmtrace.records import Trace


class Fork(Observer):
    """An observer that keeps what the original's step `at` leaves for the branches: its raw
    logits (1, vocab), the tokens its grammar allowed (vocab,) (None: unconstrained), the random
    stream after its draw, the other observers' captures of the forward behind it (`saved`) and
    which of that forward's positions was the step's (`position`)."""

    def __init__(self, at: int, watchers: Sequence[Observer]):
        self.at, self.watchers = at, list(watchers)
        self.logits: torch.Tensor | None = None
        self.allowed: torch.Tensor | None = None
        self.rng_state: torch.Tensor | None = None
        self.saved: list = []
        self.position = 0
        self.selected = 0  # the position the speculative loop selected for the step observed next

    def select(self, at: int) -> None:
        self.selected = at

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> None:
        if step.index == self.at:
            self.logits = logits.clone()
            self.allowed = None if step.allowed is None else step.allowed[0].clone()
            self.rng_state = None if how.rng is None else how.rng.get_state()
            self.saved, self.position = [o.snapshot() for o in self.watchers], self.selected


class Session:
    """One prompt's original decoding and its branches, each decoded speculatively as `plan` asks
    (its draft and draft_tokens, its observers, processors and grammar)."""

    def __init__(self, lm: LM, prompt: str, ids: list[int], plan: Plan):
        self.lm, self.prompt, self.ids, self.plan, self.p = lm, prompt, ids, plan, plan.params
        self.eos = set(lm.eos_token_ids) if self.p.stop_on_eos else set()
        self.prompt_logprobs: list | None = None  # with echo: the original's, every branch's too

    def original(self, at: int) -> tuple[Trace, Fork]:
        """generate's own drafted run, with the fork at `at` kept."""
        fork = Fork(at, self.plan.watchers)
        row = RowState(self.lm, self.p)
        tallies = [t for _, _, t in speculative.iter_rows(self.lm, self.plan, [self.ids], [row], [fork])]
        self.prompt_logprobs = row.prompt_logprobs
        trace = traced(self.lm, self.plan, [self.prompt], [self.ids], [row])[0]
        trace.speculative = tallies[-1].to_dict() if tallies else None
        return trace, fork

    def branch(self, original: Trace, fork: Fork, at: int, token: int) -> Trace:
        """The original's steps before `at`, `token` forced at `at`, then the speculative run."""
        row = RowState(self.lm, self.p)
        for s in original.steps[:at]:  # replays the detokenizer; the original stopped at none of these
            row.add(s.token_id, False)
        row.steps = [dataclasses.replace(s) for s in original.steps[:at]]
        row.prompt_logprobs = self.prompt_logprobs
        hook = lambda r, t: row.add(t, t in self.eos)  # noqa: E731
        draft, k = self.plan.draft, self.plan.options.draft_tokens
        tally = speculative.Tally(draft.spec, k, draft.describe())
        for _ in records(self.lm, [self.ids], self._steps(original, fork, token, (hook, tally)), [row]):
            pass
        trace = traced(self.lm, self.plan, [self.prompt], [self.ids], [row])[0]
        trace.speculative = tally.to_dict()
        return trace

    def _steps(
        self, original: Trace, fork: Fork, token: int, counted: tuple[Any, speculative.Tally]
    ) -> Iterator[BatchStep]:
        """The forced step at `at` (the observers back at the forward behind it), then the
        speculative run after it; `counted`: the hook that sees each token and the branch's Tally."""
        lm, p, plan, (hook, tally), at = self.lm, self.p, self.plan, counted, fork.at
        before = original.token_ids[:at]
        how = self._choosing(before, fork)
        how.forced = torch.tensor([token], device=fork.logits.device)
        eos = sorted(self.eos)
        setup = engine.Setup(eos, lm.pad_token_id, hook, False, plan.watchers, how.grammars, plan.user)
        drafting = speculative.Drafting(plan.draft.model, plan.options.draft_tokens, tally)
        fields = ledger.KVState.__dataclass_fields__
        kv = ledger.KVState(**{k: v for k, v in original.steps[at].kv.items() if k in fields})
        with attached(plan.watchers, lm.model):
            for observer, saved in zip(plan.watchers, fork.saved):
                observer.restore(saved, [self.ids + before])
                observer.select(fork.position)
            watch = Watch(plan.watchers, finish=Finish(eos, p, hook))
            for _, step in drive(Once(Fed(at, fork.logits, how, [True], kv, watch))):
                step.draft = [None]  # the forced token: no proposal
                yield step
            if step.finish[0] is not None:
                return
            run = speculative.Speculation(lm.model, self.ids, p, how.rng, setup, drafting)
            run.forced([*before, token])
            while not run.done:
                yield from run.block()

    def _choosing(self, before: list[int], fork: Fork) -> Choosing:
        """How step `at` chose: the random stream after the original's draw there, the penalty's
        seen tokens, the processors' history and the grammar as they stood before its token."""
        lm, p = self.lm, self.p
        rng = None
        if fork.rng_state is not None:
            rng = torch.Generator(device=lm.model.device)
            rng.set_state(fork.rng_state)
        grammars = constrained.matchers(lm, [p])
        for t in before if grammars is not None else ():  # the grammar replayed to where the original stood
            grammar.accept(grammars, torch.tensor([t]), [True])
        return choosing(Rows([p], rng, [self.ids], [before], grammars=grammars, user=self.plan.user), lm.model)
