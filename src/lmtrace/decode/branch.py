"""Branching: decode once, then again with the token at step `at` replaced by the K-th most
likely token under the raw distribution (K = 2 is the runner-up), continuing with the same
settings.

Every branch reuses the original's KV cache for the shared prefix: the cache is cropped back to
the prompt and the steps before `at`, and only the new tokens are fed. The raw distribution at
`at` is kept from the original run, so not even that position is recomputed. A sampled branch
continues with the random stream as it stood after the original's draw at `at`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.decode import branch_draft, branch_static, constrained, engine, observers
from lmtrace.decode.choosing import Rows, choosing
from lmtrace.decode.loop import Fed, Finish, Watch, drive
from lmtrace.decode.observers import Observer
from lmtrace.decode.options import GenerateOptions, Plan, plan
from lmtrace.decode.row_state import RowState, generator, records, seeded
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.decode.tracing import encode_prompt, traced
from lmtrace.errors import GenerationError, InvalidParameter
from lmtrace.kv import ledger
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams, check_integer
from lmtrace.records import Trace


@dataclass
class Branches:
    """The original decoding first, then one trace per branch; `alternatives[i]` is the rank
    forced at step `at` in trace i (None for the original)."""

    at: int
    alternatives: list[int | None]
    traces: list[Trace]

    def labels(self) -> list[str]:
        return ["original" if k is None else f"alternative {k} at step {self.at}" for k in self.alternatives]

    def to_dict(self) -> dict[str, Any]:
        # a trace's `label` names its column in reports (Trace.from_dict ignores it)
        branches = [{**t.to_dict(), "label": label} for t, label in zip(self.traces, self.labels())]
        return {"at": self.at, "alternatives": self.alternatives, "branches": branches}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Branches:
        return cls(d["at"], list(d["alternatives"]), [Trace.from_dict(t) for t in d["branches"]])


@dataclass
class _Fork:
    """What the original run leaves at step `at` for the branches to start from."""

    logits: torch.Tensor | None = None  # (1, vocab) raw
    seen: torch.Tensor | None = None  # (1, vocab) tokens before `at` (repetition penalty)
    rng_state: torch.Tensor | None = None  # after the original's draw at `at`
    saved: list | None = None  # each observer's snapshot of the forward behind `at` (lens, attention, attribution)
    matcher: Any = None  # the grammar before `at`'s token (a fork; None: unconstrained)
    allowed: torch.Tensor | None = None  # (vocab,) the tokens the grammar allowed at `at`
    history: list[int] | None = None  # the tokens before `at`, for the user's processors


@dataclass
class _From:
    """Where a decoding run starts: step `start`, whose raw distribution is `logits` (1, vocab),
    with the cache holding prompt_len + start positions; `forced` replaces the token chosen at
    `start`; `fork` = (step, _Fork) saves what the branches need at that step."""

    logits: torch.Tensor
    start: int
    prompt_len: int
    forced: int | None = None
    fork: tuple[int, _Fork] | None = None


def _decode(
    lm: LM,
    cache,
    at: _From,
    how: Choosing,
    hook: Callable[[int, int], bool],
    watchers: Sequence[Observer],
    forward: branch_static.Forward = engine.decode_step,
) -> Iterator[BatchStep]:
    """The decoding loop for one sequence from step `at.start`: decode/loop.py's `drive` over a
    `_Line` (engine.generate_steps's steps for a batch of one, the plan's observers); `forward`
    feeds each token (with compile, the compiled one: decode/branch_static.py)."""
    p = how.params[0]
    eos = sorted(lm.eos_token_ids) if p.stop_on_eos else []
    line = _Line(lm, cache, at, how, Watch(watchers, finish=Finish(eos, p, hook)), forward, watchers)
    for _, step in drive(line):
        yield step


class _Line:
    """One sequence as the loop's source: from step `at.start` (its raw distribution kept, its
    token forced where `at.forced` says) until it finishes; saves the fork at `at.fork`'s step."""

    def __init__(
        self,
        lm: LM,
        cache,
        at: _From,
        how: Choosing,
        watch: Watch,
        forward: branch_static.Forward,
        watchers: Sequence[Observer],
    ):
        self.lm, self.cache, self.at, self.how, self.watch = lm, cache, at, how, watch
        self.forward, self.watchers = forward, watchers
        self.index, self.logits, self.done = at.start, at.logits, False
        self.expected = engine.expected_bytes(lm.model, 1)

    def _saving(self) -> bool:
        return self.at.fork is not None and self.index == self.at.fork[0]

    def next(self) -> Fed | None:
        if self.done or self.index >= self.how.params[0].max_new_tokens:
            return None
        forced = self.at.forced is not None and self.index == self.at.start
        self.how.forced = torch.tensor([self.at.forced], device=self.logits.device) if forced else None
        if self._saving():  # before the step's token moves the grammar
            _save_grammar(self.at.fork[1], self.how)
        return Fed(self.index, self.logits, self.how, [True], ledger.state(self.cache, self.expected), self.watch)

    def chose(self, tokens: torch.Tensor, step: BatchStep) -> None:
        if self._saving():  # the seen mask and the history move only after the step is yielded
            _save(self.at.fork[1], self.logits, self.how, step, self.watchers)

    def took(self, tokens: torch.Tensor, step: BatchStep | None) -> None:
        self.done = step.finish[0] is not None
        position = torch.tensor([[self.at.prompt_len + self.index]], device=self.logits.device)
        self.index += 1
        if not self.done and self.index < self.how.params[0].max_new_tokens:
            self.logits = self.forward(self.lm.model, tokens, position, None, self.cache)


def _save_grammar(fork: _Fork, how: Choosing) -> None:
    """The grammar as it stands before the fork step's token (a fork of the matcher)."""
    if how.grammars is not None and how.grammars[0] is not None:
        fork.matcher = how.grammars[0].fork()


def _save(fork: _Fork, logits: torch.Tensor, how: Choosing, step: BatchStep, watchers: Sequence[Observer]) -> None:
    """The fork point: the raw distribution, the penalty mask and the history before this step's
    token, the random stream after its draw, the tokens the grammar allowed, the observers'
    snapshots of the forward behind it."""
    seen = how.batch_seen()
    fork.logits, fork.seen = logits.clone(), None if seen is None else seen.clone()
    fork.rng_state = None if how.rng is None else how.rng.get_state()
    fork.allowed = None if step.allowed is None else step.allowed[0].clone()
    fork.history = None if how.history is None else list(how.history[0])
    fork.saved = [o.snapshot() for o in watchers]


def _ranks(alternatives: Sequence[int] | None, fan: int | None, vocab: int) -> list[int]:
    if alternatives and fan is not None:
        raise InvalidParameter("alternative: give alternative ranks or fan, not both")
    if fan is not None:
        return list(range(1, check_integer("fan", fan, low=1, high=vocab) + 1))
    ranks = list(alternatives) if alternatives else [2]
    for k in ranks:
        check_integer("alternative", k, low=1, high=vocab)
    return list(dict.fromkeys(ranks))


class _Session:
    """One prompt's original decoding and its branches, sharing one KV cache, as `plan` asks."""

    def __init__(self, lm: LM, prompt: str, ids: list[int], plan: Plan):
        self.lm, self.prompt, self.ids, self.plan, self.p = lm, prompt, ids, plan, plan.params
        engine.check_context(lm.model, [self.ids], self.p)
        self.decoding = branch_static.decoding(lm, plan, len(ids))  # with compile: static, compiled
        self.cache = self.decoding.cache
        self.eos = set(lm.eos_token_ids) if self.p.stop_on_eos else set()
        self.prompt_logprobs: list | None = None  # with echo: the original's, every branch's too

    def _trace(self, make_steps: Callable, prefix: Sequence = ()) -> Trace:
        """A Trace from a _decode run; `prefix` holds the original's Steps before the branch point."""
        row = RowState(self.lm, self.p)
        for s in prefix:  # replays the detokenizer; the original stopped at none of these tokens
            row.add(s.token_id, False)
        row.steps = [dataclasses.replace(s) for s in prefix]
        row.prompt_logprobs = self.prompt_logprobs
        hook = lambda r, t: row.add(t, t in self.eos)  # noqa: E731
        for _ in records(self.lm, [self.ids], make_steps(hook), [row]):
            pass
        self.prompt_logprobs = row.prompt_logprobs
        return traced(self.lm, self.plan, [self.prompt], [self.ids], [row])[0]

    def original(self, at: int) -> tuple[Trace, _Fork]:
        lm, p, fork, plan = self.lm, self.p, _Fork(), self.plan
        ids = torch.tensor([self.ids], device=lm.model.device)
        logits = engine.prefill_observed(lm.model, ids, torch.ones_like(ids), False, self.cache, plan.watchers)
        rows = Rows([p], generator(lm, p), [self.ids], [[]], grammars=constrained.matchers(lm, [p]), user=plan.user)
        how = choosing(rows, lm.model)
        start = _From(logits, 0, len(self.ids), fork=(at, fork))
        forward = self.decoding.forward
        trace = self._trace(lambda hook: _decode(lm, self.cache, start, how, hook, plan.watchers, forward))
        return trace, fork

    def branch(self, original: Trace, fork: _Fork, at: int, token: int) -> Trace:
        try:
            ledger.crop(self.cache, len(self.ids) + at)
        except (RuntimeError, ValueError) as e:  # e.g. a sliding-window layer past its window
            raise GenerationError(
                f"branch: this model's cache cannot be cut back to {len(self.ids) + at} positions ({e})"
            ) from e
        rng = None
        if fork.rng_state is not None:
            rng = torch.Generator(device=self.lm.model.device)
            rng.set_state(fork.rng_state)
        for observer, saved in zip(self.plan.watchers, fork.saved or []):
            observer.restore(saved, [self.ids + original.token_ids[:at]])
        grammars = None if fork.matcher is None else [fork.matcher.fork()]
        made = None if fork.history is None else [fork.history]
        seen = None if fork.seen is None else fork.seen.clone()
        how = choosing(Rows([self.p], rng, None, made, seen, grammars, self.plan.user))
        start = _From(fork.logits, at, len(self.ids), forced=token)

        def make_steps(hook):
            return _decode(self.lm, self.cache, start, how, hook, self.plan.watchers, self.decoding.forward)

        return self._trace(make_steps, prefix=original.steps[:at])


def branch(
    lm: LM,
    prompt: str,
    at: int,
    alternatives: Sequence[int] | None = None,
    *,
    fan: int | None = None,
    params: SamplingParams | None = None,
    **kwargs: Any,
) -> Branches:
    """Decodes `prompt`, then once more per alternative rank K with the token at step `at`
    replaced by the K-th most likely raw token (default K = 2). `fan=K` branches on each of the
    K most likely tokens other than the one the original chose. The keyword arguments are
    lmtrace.generate's (the sampling settings and lmtrace.GenerateOptions): the original is
    generate's own trace and every branch records what it records (its echo, waterfall, lens,
    attention, uncertainty, attribution; its processors and penalty see the branch's own tokens);
    under a constraint every branch decodes under the grammar, and the alternatives are ranked
    among the tokens it allows at `at`. `draft` decodes the original and every branch
    speculatively, with the same options (decode/branch_draft.py); `compile` decodes them with the
    compiled forward on a static cache (decode/branch_static.py)."""
    options = GenerateOptions.of(params, "branch", **kwargs)
    options = dataclasses.replace(options, params=seeded(options.params))
    p = options.params
    check_integer("at", at, low=0, high=p.max_new_tokens - 1)
    ranks = _ranks(alternatives, fan, int(lm.model.config.vocab_size))
    ids = encode_prompt(lm, prompt, options.chat)
    if options.draft is not None:
        return _drafted(lm, prompt, ids, at, (ranks, fan is not None), options)
    the_plan = plan(lm, options, [ids])
    session = _Session(lm, prompt, ids, the_plan)
    with torch.inference_mode(), observers.attached(the_plan.watchers, lm.model):
        return _fanned(session, at, ranks, fan is not None)


def _order(fork: _Fork | branch_draft.Fork, ranks: list[int], at: int, fan: bool) -> list[int]:
    """The tokens by their raw probability at `at` (under a constraint: the tokens its grammar
    allowed there), as many as the highest rank asks for; an explicit rank past the allowed
    tokens is refused in one line."""
    logits = fork.logits[0]
    allowed = int(logits.numel()) if fork.allowed is None else int(fork.allowed.sum())
    if fork.allowed is not None:
        logits = logits.masked_fill(~fork.allowed, float("-inf"))
    if not fan and max(ranks) > allowed:
        raise InvalidParameter(
            f"alternative: the constraint allows {allowed} tokens at step {at}, got rank {max(ranks)}"
        )
    return torch.topk(logits, min(max(ranks), allowed)).indices.tolist()


# what a drafted branch (decode/branch_draft.py) refuses beside what generate refuses with a draft:
# compile, as every branch does
DRAFTED_ALONE = ("compile",)


def _drafted(
    lm: LM, prompt: str, ids: list[int], at: int, ranked: tuple[list[int], bool], options: GenerateOptions
) -> Branches:
    """The original and every branch decoded speculatively (decode/branch_draft.py), with every
    option generate takes beside a draft."""
    for name in DRAFTED_ALONE:
        if getattr(options, name):
            raise InvalidParameter(f"draft and {name}: branch does not take {name}; drop {name}")
    the_plan = plan(lm, options, [ids])  # the draft loaded, its arguments checked
    session = branch_draft.Session(lm, prompt, ids, the_plan)
    ranks, fan = ranked
    with torch.inference_mode():
        return _fanned(session, at, ranks, fan)


def _fanned(session: _Session | branch_draft.Session, at: int, ranks: list[int], fan: bool) -> Branches:
    """The original, then a branch per rank asked for (a fan: the ranks but the original's own
    token), from the fork the original kept at `at`."""
    original, fork = session.original(at)
    if fork.logits is None:
        raise InvalidParameter(f"at must be a step the decoding reached (0..{len(original.steps) - 1}), got {at}")
    order = _order(fork, ranks, at, fan)
    if fan:  # the original's own token is the original, not a branch
        ranks = [k for k in ranks if k <= len(order) and order[k - 1] != original.steps[at].token_id]
    traces = [original] + [session.branch(original, fork, at, order[k - 1]) for k in ranks]
    return Branches(at, [None, *ranks], traces)
