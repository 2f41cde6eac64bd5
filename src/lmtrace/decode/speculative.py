"""Speculative decoding, traced: a draft model proposes K tokens with its own KV cache, the
target scores them in one forward over its cache, and the one step (decode/step.py `take`)
judges each proposal in turn (lmtrace.logits.acceptance) and measures the token it emits under
the target's distributions, so every number of a step is the target's own. The first rejected
proposal ends the block with the target's token in its place; when all K are accepted the
target's distribution after them gives one more token (the bonus). Both caches are cropped
back to the tokens kept, and the step that ends the block records the crop.

    target holds seq[:-1] (after the prefill: all of seq, and the logits it owes)
    draft  feeds what it has not seen, proposes d0..d{K-1} (K forwards)
    target feeds [last token, d0..d{K-1}]: K+1 distributions, one per step of the block

One row (batch 1); a batch of prompts decodes one prompt after another (decode/tracing.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace.decode import constrained, engine, static
from lmtrace.decode.block_size import AUTO, BlockSize
from lmtrace.decode.choosing import Rows, choosing, forked
from lmtrace.decode.loop import Fed, Finish, Watch, drive
from lmtrace.decode.observers import Observer, attached
from lmtrace.decode.row_state import RowState, generator, records
from lmtrace.decode.step import BatchStep, Choosing, Proposal
from lmtrace.kv import ledger
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Step


@dataclass
class Tally:
    """What a speculative run counts: each block's proposals and verdicts (up to the first
    rejection, or to a stop), and the forward passes of each model."""

    draft: str
    draft_tokens: int | str  # "auto": each block's K chosen by decode/block_size.py
    draft_model: dict[str, Any] = field(default_factory=dict)
    blocks: list[tuple[int, list[bool]]] = field(default_factory=list)  # (proposed, verdicts)
    target_forwards: int = 0
    draft_forwards: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The trace's `speculative` field. `acceptance_by_position[j]`: the share of blocks that
        proposed a token at position j where it was accepted (all before it too);
        `conditional_acceptance_by_position[j]`: the same among blocks that reached position j."""
        by, conditional = [], []
        width = max((n for n, _ in self.blocks), default=0) if self.draft_tokens == AUTO else self.draft_tokens
        for j in range(width):
            known = [v for n, v in self.blocks if n > j and (len(v) > j or (v and not v[-1]))]
            by.append(_rate([len(v) > j and all(v[: j + 1]) for v in known]))
            conditional.append(_rate([v[j] for n, v in self.blocks if len(v) > j and all(v[:j])]))
        kept = [_leading(v) for n, v in self.blocks if n > 0]
        return {
            "draft": self.draft,
            "draft_tokens": self.draft_tokens,
            "acceptance_by_position": by,
            "conditional_acceptance_by_position": conditional,
            "mean_accepted_per_block": sum(kept) / len(kept) if kept else None,
            **({"proposed_per_block": [n for n, _ in self.blocks]} if self.draft_tokens == AUTO else {}),
            "blocks": len(self.blocks),
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "draft_model": self.draft_model,
        }


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _leading(verdicts: list[bool]) -> int:
    return next((i for i, v in enumerate(verdicts) if not v), len(verdicts))


@dataclass
class Drafting:
    """The draft side of a speculative run: the draft model, the tokens it proposes a block (K,
    or "auto": chosen per block, decode/block_size.py), what is counted, whether its one-token
    step runs compiled on a static cache."""

    model: Any
    k: int | str
    tally: Tally
    compile: bool = False


# tokens a compiled draft step takes at most (one graph per count: 1 and 2)
STEP_TOKENS = 2


class Side:
    """One model of the pair: its cache (croppable) and its forward passes. `static_len`: a
    StaticCache of that many positions and a torch.compile'd one-token step (a draft's `compile`)."""

    def __init__(self, model: Any, static_len: int | None = None):
        self.model = model
        self.cache = ledger.new_cache(model, static_len, croppable=True)
        self.step = static.compiled_forward(model) if static_len is not None else None
        self.forwards = 0

    @property
    def fed(self) -> int:
        return ledger.seq_length(self.cache)

    def feed(self, tokens: Sequence[int], keep: int) -> torch.Tensor:
        """Feeds `tokens` after the cached ones; float32 logits of the last `keep` positions
        (keep, vocab)."""
        start = self.fed
        device = self.model.device
        if self.step is not None and start > 0 and keep == 1:  # compiled graphs of one and of two tokens
            for at in range(0, len(tokens), STEP_TOKENS):  # two: a fully accepted block's last proposal and bonus
                part = torch.tensor([list(tokens[at : at + STEP_TOKENS])], device=device)  # (1, n)
                positions = torch.arange(start + at, start + at + part.shape[1], device=device)[None]  # (1, n)
                logits = self.step(self.model, part, positions, None, self.cache)
                self.forwards += 1
            return logits.float()  # (1, vocab)
        out = self.model(
            input_ids=torch.tensor([list(tokens)], device=device),  # (1, n)
            position_ids=torch.arange(start, start + len(tokens), device=device)[None],  # (1, n)
            logits_to_keep=keep,
            **ledger.cache_kwargs(self.model, self.cache),
        )
        self.forwards += 1
        return out.logits[0].float()  # (1, keep, vocab) -> (keep, vocab)


def fit(logits: torch.Tensor, width: int) -> torch.Tensor:
    """A draft's logits (rows, vocab') on the target's vocabulary width: ids the target lacks
    are cut, ids the draft lacks can never be proposed (-inf)."""
    have = logits.shape[-1]
    if have == width:
        return logits
    if have > width:
        return logits[..., :width]
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], width - have), float("-inf"))], dim=-1)


def propose(draft: Side, seq: list[int], k: int, how: Choosing, block: int, width: int) -> list[Proposal]:
    """The draft's K proposals, each drawn from its processed distribution under `how`, the row's
    rule (the target's processors, the seen tokens including the proposals before it). A
    constrained row's draft proposes under the same grammar: a fork of the row's matcher moves
    past each proposal (the row's own matcher moves only past the tokens the verification emits)."""
    if k == 0:
        return []
    logits = fit(draft.feed(seq[draft.fed :], keep=1), width)  # (1, vocab)
    own = forked(how)  # its seen tokens, grammar and history moved by the proposals alone
    grammars = own.grammars if own.grammars is not None and own.grammars[0] is not None else None
    out: list[Proposal] = []
    for j in range(k):
        allowed = own.allowed(width, [True])  # (1, vocab) bool, None unconstrained
        q = own.process(logits, allowed)
        token = own.choose(q)  # (1,)
        out.append(Proposal(int(token[0]), q, j, block))
        own.saw(token)
        if grammars is not None and not grammars[0].done and not grammars[0].accept(int(token[0])):
            break  # nothing the grammar allows could be proposed here: the block is shorter
        if j < k - 1:
            logits = fit(draft.feed([int(token[0])], keep=1), width)
    return out


def verify(target: Side, seq: list[int], proposals: list[Proposal], held: torch.Tensor | None) -> torch.Tensor:
    """The target's K+1 raw distributions (K+1, vocab): for each proposal, then the bonus."""
    feed = seq[target.fed :] + [p.token_id for p in proposals]
    rows = [held] if held is not None else []
    if feed:
        rows.append(target.feed(feed, keep=len(proposals) + 1 - len(rows)))
    return torch.cat(rows)


class Speculation:
    """One prompt decoded speculatively, a block at a time: `prefill()` once, then `block()` (the
    block's steps, lazily) until `done`. It holds no context across calls: the caller runs each
    under torch.inference_mode (generate_steps below; a continuous batch's drafted row)."""

    def __init__(
        self,
        model: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        rng: Any,
        setup: engine.Setup,
        drafting: Drafting,
    ):
        engine.check_context(model, [prompt_ids], params)
        size, tally = BlockSize.of(drafting.k), drafting.tally
        self.model, self.params, self.rng, self.setup, self.size, self.tally = model, params, rng, setup, size, tally
        self.prompt_len, self.seq = len(prompt_ids), list(prompt_ids)
        length = None
        if drafting.compile:  # room for the prompt, the tokens and a block past them, in whole buckets
            length = static.capacity(len(self.seq) + params.max_new_tokens + size.largest + 1)
        self.target, self.proposer = Side(model), Side(drafting.model, length)
        self.how = choosing(Rows([params], rng, [self.seq], [[]], grammars=setup.grammars, user=setup.user), model)
        self.loop = _Loop(self.target, self.proposer, params, setup, tally, engine.expected_bytes(model, 1), size)
        self.held: torch.Tensor | None = None  # the prefill's distribution, owed to the first block
        self.held_saved: list = []  # the observers' captures of the prefill, for that step
        self.width = 0  # the target's vocabulary: a draft's logits are fitted to it

    @property
    def made(self) -> int:
        return len(self.seq) - self.prompt_len

    @property
    def done(self) -> bool:
        return self.loop.done or self.made >= self.params.max_new_tokens

    def prefill(self) -> None:
        ids = torch.tensor([self.seq], device=self.model.device)
        self.held = engine.prefill_observed(self.model, ids, torch.ones_like(ids), False, self.target.cache,
                                            self.setup.observers)  # fmt: skip
        self.target.forwards += 1
        self.width = self.held.shape[-1]
        self.held_saved = [o.snapshot() for o in self.setup.observers]

    def forced(self, tokens: Sequence[int]) -> None:
        """Instead of `prefill`: the run goes on after `tokens`, generated already (a branch's forced
        prefix, whose steps the caller recorded). The target is fed the prompt and them but the
        last (its next block starts from the last), the draft catches up as it proposes; the
        penalty and the user's processors see them; the steps go on numbered after them."""
        self.seq += list(tokens)
        self.width = self.target.feed(self.seq[:-1], keep=1).shape[-1]
        prompt, made = [self.seq[: self.prompt_len]], [self.seq[self.prompt_len :]]
        rows = Rows([self.params], self.rng, prompt, made, grammars=self.setup.grammars, user=self.setup.user)
        self.how = choosing(rows, self.model)

    def block(self) -> Iterator[BatchStep]:
        """The draft's proposals and the target's verification forward now; the block's steps
        as they are judged (up to the first rejected proposal, then the target's own token)."""
        k_now = min(self.size.next(), self.params.max_new_tokens - self.made - 1)
        unseen = len(self.seq) - self.proposer.fed  # the draft's first block feeds it the whole prompt
        began = time.perf_counter()
        proposals = propose(self.proposer, self.seq, k_now, self.how, len(self.tally.blocks), self.width)
        drafted = time.perf_counter()
        observers = self.setup.observers
        fed = len(proposals) + (1 if self.held is None else 0)  # the verify forward's steps
        for o in observers:
            o.positions(fed)
        rows = verify(self.target, self.seq, proposals, self.held)  # (k_now + 1, vocab)
        # what the block cost: its draft steps, its verify forward and that forward's rows
        cost = (drafted - began, len(proposals) if unseen <= 2 else 0, time.perf_counter() - drafted, fed)
        saved = [o.snapshot() for o in observers]
        for o in observers:
            o.positions(1)
        # each step's captures: the prefill's for a first block's first step, else the verify forward's
        captured = [(saved, i) for i in range(fed)]
        if self.held is not None:
            captured.insert(0, (self.held_saved, 0))
        self.held = None
        return self.loop.block(self.seq, (self.made, proposals, rows, cost), self.how, captured)


def generate_steps(
    model: Any, prompt_ids: Sequence[int], params: SamplingParams, rng: Any, setup: engine.Setup, drafting: Drafting
) -> Iterator[BatchStep]:
    """Decodes one prompt with the draft proposing K tokens a block; yields one BatchStep per
    token, as engine.generate_steps does, with the step's `draft` verdict (None: a bonus token).
    With `drafting.compile` the draft's step runs torch.compile'd on a static cache (a one-off compile)."""
    run = Speculation(model, prompt_ids, params, rng, setup, drafting)
    with torch.inference_mode(), attached(setup.observers, model):
        run.prefill()
        while not run.done:
            yield from run.block()


@dataclass
class _Loop:
    """The state a block's steps share: both models' sides, how to choose, what is counted."""

    target: Side
    proposer: Side
    params: SamplingParams
    setup: engine.Setup
    tally: Tally
    expected: Any
    size: BlockSize
    done: bool = False
    started: float = field(default_factory=time.perf_counter)

    def observe_at(self, captured: tuple[list, int], seq: list[int]) -> None:
        """The observers back to the forward that made this step, at its position there."""
        saved, at = captured
        for o, state in zip(self.setup.observers, saved):
            o.restore(state, [list(seq)])
            o.select(at)

    def block(
        self,
        seq: list[int],
        judged: tuple,
        how: Choosing,
        captured: Sequence[tuple[list, int]] = (),
    ) -> Iterator[BatchStep]:
        """The block's steps (decode/loop.py's `drive` over a `_Block`): each proposal judged in
        turn until one is rejected, then the bonus; `seq` gets the emitted tokens. `judged`: as
        `_Block`'s. `captured`: each step's observer snapshots and its position among the
        positions they kept."""
        for _, step in drive(_Block(self, seq, judged, how, captured), self.started):
            yield step


class _Block:
    """A speculative block as the loop's source: step i's logits are the verify forward's row i,
    judged against proposal i (the bonus past the last); the block ends at a rejection, the
    bonus or a finish, where both caches are cropped back to the emitted tokens but the last.
    `judged` = (the first step's index, the proposals, the verify forward's rows, what the block
    cost: (draft seconds, draft steps, verify seconds, verify rows), for `auto`'s next K)."""

    def __init__(self, loop: _Loop, seq: list[int], judged: tuple, how: Choosing, captured: Sequence):
        self.loop, self.seq, self.how, self.captured = loop, seq, how, captured
        self.index, self.proposals, self.rows, self.cost = judged
        self.i, self.verdicts, self.ended = 0, [], False
        setup = loop.setup
        self.watch = Watch(setup.observers, finish=Finish(setup.eos_token_ids, loop.params, setup.on_token))

    def next(self) -> Fed | None:
        if self.ended:
            return None
        i, loop = self.i, self.loop
        if i < len(self.captured):
            loop.observe_at(self.captured[i], self.seq)
        self.how.draft = self.proposals[i] if i < len(self.proposals) else None
        kv = ledger.prefix_state(loop.target.cache, len(self.seq), loop.expected)
        return Fed(self.index + i, self.rows[i : i + 1], self.how, [True], kv, self.watch)

    def chose(self, tokens: torch.Tensor, step: BatchStep) -> None:
        loop, proposal = self.loop, self.how.draft
        step.draft = step.draft or [None]
        self.seq.append(int(tokens[0]))
        if proposal is not None:
            self.verdicts.append(proposal.accepted)
        loop.done = step.finish[0] is not None
        self.ended = loop.done or proposal is None or not proposal.accepted
        if self.ended:  # the block ends at this step: the caches keep the emitted tokens but the last
            loop.tally.blocks.append((len(self.proposals), self.verdicts))
            loop.size.measured(self.verdicts, *self.cost)
            step.crop = _crop(loop.target, loop.proposer, len(self.seq) - 1)
            loop.tally.target_forwards, loop.tally.draft_forwards = loop.target.forwards, loop.proposer.forwards

    def took(self, tokens: torch.Tensor, step: BatchStep | None) -> None:
        self.i += 1
        self.loop.started = time.perf_counter()  # the next block's first step counts its forwards


def _crop(target: Side, draft: Side, keep: int) -> dict[str, Any] | None:
    """Both caches back to the first `keep` positions (the emitted tokens but the last);
    {target: {...}, draft: {...}} where anything was cut (ledger.crop)."""
    cut = {"target": ledger.crop(target.cache, keep), "draft": ledger.crop(draft.cache, keep)}
    cut = {name: c for name, c in cut.items() if c is not None}
    return cut or None


def iter_rows(
    lm: LM, plan: Any, prompts: Sequence[list[int]], rows: list[RowState], extra: Sequence[Observer] = ()
) -> Iterator[tuple[int, Step, Tally]]:
    """Each prompt decoded alone with the plan's draft (decode/options.py Plan), one after another,
    drawing from one generator seeded by the params (the first prompt draws as it would alone);
    yields (row, Step, the row's Tally) as steps are produced. `extra`: observers of the caller's
    beside the plan's."""
    params, draft, watchers = plan.params, plan.draft, [*plan.watchers, *extra]
    eos = set(lm.eos_token_ids) if params.stop_on_eos else set()
    rng = generator(lm, params)
    for r, ids in enumerate(prompts):

        def hook(row: int, token: int, r: int = r) -> bool:
            return rows[r].add(token, token in eos)

        for o in watchers:  # each prompt its own generation
            o.start([ids])
        k = plan.options.draft_tokens
        drafting = Drafting(draft.model, k, Tally(draft.spec, k, draft.describe()), plan.options.compile)
        grammars = constrained.matchers(lm, [params])
        setup = engine.Setup(sorted(eos), lm.pad_token_id, hook, False, watchers, grammars, plan.user)
        steps = generate_steps(lm.model, ids, params, rng, setup, drafting)
        for _, step in records(lm, [ids], steps, [rows[r]]):
            yield r, step, drafting.tally
