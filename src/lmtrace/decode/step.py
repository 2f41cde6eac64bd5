"""The one decoding step: from a batch's raw logits and how each row chooses, the chosen tokens
with their measured numbers: `take`, in two halves, `pick` (the choice) and `measured` (its
numbers), so that a loop can start the next forward from the picked tokens while the step is
measured. The one loop (decode/loop.py `drive`) reaches it through `advance` (the step with the
observers and the finish reasons; `settle` is its second half), the only caller of `take`; speculative
decoding and grammar masks change the step here and nowhere else.

    how = choosing(Rows([params], rng, prompts))         # decode/choosing.py: one params, or one per row
    tokens, step = take(index, logits, how, active, kv)  # logits (batch, vocab) float32 raw
    picked = pick(logits, how, active)                  # or in two halves: the tokens first,
    step = measured(index, logits, picked, how, active, kv)  # the numbers beside the next forward

A constrained row's grammar mask is the first stage, as vLLM applies it: the processors work on
the masked logits, so `sampled_logprob` is under the distribution the token was drawn from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmtrace.errors import GenerationError, InvalidParameter
from lmtrace.kv import ledger
from lmtrace.logits import acceptance, grammar, measure, processors, sampling
from lmtrace.params import SamplingParams
from lmtrace.stops import finish_reason

# on_token(row, token_id) -> True when the row must stop (a stop string was completed)
TokenHook = Callable[[int, int], bool]


@dataclass
class BatchStep:
    """Numbers for one step of every row in the batch (lists indexed by row)."""

    index: int
    token_ids: list[int]
    active: list[bool]  # rows that were still generating at this step
    finish: list[str | None]  # "eos", "stop" or "length" where a row ends at this step
    logprob: list[float]
    sampled_logprob: list[float]
    rank: list[int]
    entropy: list[float]
    sampled_entropy: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    top_sampled_logprobs: list[list[float]]
    kv: ledger.KVState
    time_ms: float
    # constrained rows (lmtrace.logits.grammar.numbers; None for an unconstrained row) and the
    # grammar's mask (batch, vocab) bool that made them, for the observers
    grammar: list[dict | None] | None = None
    allowed: torch.Tensor | None = None
    # speculative decoding: the draft's proposal judged at this step (Proposal.record), None for
    # a bonus token; the field itself None outside speculative decoding
    draft: list[dict | None] | None = None
    # speculative decoding: the target's and the draft's caches cropped after a rejection
    crop: dict | None = None
    # the observers' entries: {name: one entry per row (None: that row has none)}; the built-in
    # observers' (decode/observers.py BUILT_IN) too: `prompt` (echo: step 0, the prompt's own tokens
    # teacher-forced in the prefill pass), `waterfall` (the distribution after each sampling stage),
    # `inside` ({lens, attention}: the logit lens and the attention over the cache)
    entries: dict[str, list] = field(default_factory=dict)


@dataclass
class Proposal:
    """A draft's proposed token for one step and the processed logits it was drawn from (1,
    vocab); `position` 0-based in its block. The step judges it (lmtrace.logits.acceptance) and
    keeps the verdict here."""

    token_id: int
    processed: torch.Tensor
    position: int
    block: int = 0
    verdict: acceptance.Verdicts | None = None

    def judge(self, processed: torch.Tensor, greedy: bool, rng: torch.Generator | None) -> torch.Tensor:
        """The token (1,) this step emits: the proposal, or the target's own after a rejection."""
        proposed = torch.tensor([self.token_id], device=processed.device)
        self.verdict = acceptance.judge(processed, self.processed, proposed, greedy, rng)
        return self.verdict.tokens

    @property
    def accepted(self) -> bool:
        return self.verdict is not None and bool(self.verdict.accepted[0])

    def record(self) -> dict:
        """The step's `draft` field: {proposed_token_id, logprob (q), target_logprob (p),
        accept_prob, accepted, position, block}."""
        v = self.verdict
        return {"proposed_token_id": self.token_id, "logprob": float(v.draft_logprob[0]),
                "target_logprob": float(v.target_logprob[0]), "accept_prob": float(v.accept_prob[0]),
                "accepted": bool(v.accepted[0]), "position": self.position, "block": self.block}  # fmt: skip


@dataclass
class Choosing:
    """How the rows of a batch choose. `params` holds one SamplingParams for every row (the
    batch is processed as one tensor) or one per row (each row processed alone, with its own
    settings); `rng` one generator for the batch or one per row (None: greedy); `seen` the
    tokens so far for a repetition penalty: (batch, vocab) bool, or per row (1, vocab) or None;
    `forced` (batch,) tokens that replace the choice (a branch's alternative); `grammars` each
    row's grammar matcher (None: unconstrained), moved past each chosen token by `take`; `draft`
    a draft's proposal that the step judges instead of choosing (speculative decoding, one row).
    Made only by decode/choosing.py `choosing` (from the rows' state) and `forked` (a draft's copy)."""

    params: Sequence[SamplingParams]
    rng: sampling.Rng = None
    seen: torch.Tensor | Sequence[torch.Tensor | None] | None = None
    forced: torch.Tensor | None = None
    grammars: Sequence[grammar.Matcher | None] | None = None
    draft: Proposal | None = None
    # the user's own processors (run first, each over one row) and each row's tokens generated
    # so far, which they are handed (kept up to date by `saw`)
    user: Sequence[processors.UserProcessor] = ()
    history: list[list[int]] | None = None
    # continuous batching: each row's own processors instead of `user` (rows of different
    # requests; a row without any is left as it is)
    own_user: Sequence[Sequence[processors.UserProcessor]] | None = None

    @property
    def shared(self) -> bool:
        return len(self.params) == 1

    @property
    def top_n(self) -> int:
        return max(p.top_logprobs for p in self.params)

    def batch_seen(self) -> torch.Tensor | None:
        """The (batch, vocab) penalty mask where one tensor holds it (one row: its own)."""
        if isinstance(self.seen, torch.Tensor) or self.seen is None:
            return self.seen
        return self.seen[0] if len(self.seen) == 1 else None

    def user_of(self, row: int) -> Sequence[processors.UserProcessor]:
        """The user's processors of this row."""
        return self.user if self.own_user is None else self.own_user[row]

    def seen_of(self, row: int) -> torch.Tensor | None:
        """This row's penalty mask (1, vocab) (None: no penalty)."""
        if self.seen is None or isinstance(self.seen, torch.Tensor):
            return None if self.seen is None else self.seen[row : row + 1]
        return self.seen[row]

    def _rng(self, row: int) -> torch.Generator | None:
        return self.rng[row] if isinstance(self.rng, Sequence) else self.rng

    def allowed(self, vocab: int, active: Sequence[bool]) -> torch.Tensor | None:
        """The tokens each row's grammar allows (batch, vocab) bool; None without grammars."""
        return None if self.grammars is None else grammar.allowed_tokens(self.grammars, vocab, active)

    def process(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The distributions the rows choose from (batch, vocab): the grammar's mask first (where
        `allowed` is given), then the processors; `logits` itself where every row is greedy
        without a logit bias, penalty or grammar (one distribution, measured once)."""
        if allowed is not None:
            logits = grammar.mask(logits, allowed)
        if self.user or self.own_user is not None:  # first, once (the waterfall runs them again)
            logits = self._users(logits)
        if self.shared:
            return sampling.process_logits(logits, self.params[0], self.batch_seen())
        if all(p.greedy and not p.logit_bias for p in self.params) and all(
            self.seen_of(r) is None for r in range(len(self.params))
        ):
            return logits
        rows = [sampling.process_logits(logits[r : r + 1], p, self.seen_of(r)) for r, p in enumerate(self.params)]
        return torch.cat(rows)

    def _users(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after the user's processors (each row's own, with `own_user`)."""
        if self.own_user is None:
            out = user_only(logits, self.user, self.history)
        else:
            history = self.history or [[] for _ in self.own_user]
            rows = [logits[r : r + 1] for r in range(len(self.own_user))]
            for r, own in enumerate(self.own_user):
                if own:
                    rows[r] = user_only(rows[r], own, history[r : r + 1])
            out = torch.cat(rows)
        if not torch.isfinite(out).any(-1).all():
            names = ", ".join(dict.fromkeys(u.name for r in range(len(out)) for u in self.user_of(r)))
            raise GenerationError(f"logits_processors: {names} left no token to choose (every logit -inf)")
        return out

    def choose(self, processed: torch.Tensor) -> torch.Tensor:
        """Token ids (batch,): the forced ones, the judged proposal, else each row's argmax or draw."""
        if self.forced is not None:
            return self.forced
        if self.draft is not None:
            return self.draft.judge(processed, self.params[0].greedy, self._rng(0))
        if self.shared:
            return sampling.choose(processed, self.params[0], self.rng)
        if all(p.greedy for p in self.params):  # each row's argmax, taken together
            return sampling.choose(processed, self.params[0], None)
        rows = [sampling.choose(processed[r : r + 1], p, self._rng(r)) for r, p in enumerate(self.params)]
        return torch.cat(rows)

    def saw(self, tokens: torch.Tensor) -> None:
        """Marks the chosen tokens (batch,) as seen, for the next step's repetition penalty (and
        the user's processors)."""
        if self.history is not None:
            for row, token in zip(self.history, tokens.tolist()):
                row.append(token)
        if isinstance(self.seen, torch.Tensor):
            self.seen.scatter_(1, tokens[:, None], True)
        elif self.seen is not None:
            for row, token in enumerate(tokens.tolist()):
                if self.seen[row] is not None:
                    self.seen[row][0, token] = True


def user_only(logits: torch.Tensor, user: Sequence[processors.UserProcessor], history: list[list[int]] | None
              ) -> torch.Tensor:  # fmt: skip
    """The logits after the user's processors alone (batch, vocab)."""
    for u in user:
        logits = u(logits, history or [[]] * logits.shape[0])
    return logits


def take(
    index: int, logits: torch.Tensor, how: Choosing, active: Sequence[bool], kv: ledger.KVState
) -> tuple[torch.Tensor, BatchStep]:
    """Chooses every row's token and measures it: `pick`, then `measured`. Returns the tokens
    (batch,) and the BatchStep (finish reasons not yet set: see `finish`)."""
    picked = pick(logits, how, active)
    return picked.tokens, measured(index, logits, picked, how, active, kv)


@dataclass
class Picked:
    """A step's choice before it is measured: the tokens (batch,), the processed distributions
    they were chosen from (batch, vocab) and the grammar's mask (None without grammars)."""

    tokens: torch.Tensor
    processed: torch.Tensor
    allowed: torch.Tensor | None


def pick(logits: torch.Tensor, how: Choosing, active: Sequence[bool]) -> Picked:
    """Chooses every row's token from its processed distribution (the grammar's mask first, then
    the processors); nothing measured yet: the next forward can start from these tokens while
    `measured` runs beside it."""
    allowed = how.allowed(logits.shape[-1], active)  # (batch, vocab) bool or None
    processed = how.process(logits, allowed)
    return Picked(how.choose(processed), processed, allowed)  # tokens (batch,)


def measured(
    index: int, logits: torch.Tensor, picked: Picked, how: Choosing, active: Sequence[bool], kv: ledger.KVState
) -> BatchStep:
    """The picked tokens' numbers under the raw `logits` (batch, vocab) and the processed ones, as
    a BatchStep (finish reasons not yet set: see `finish`). With one params per row each row
    keeps its own number of alternatives. A constrained row's grammar moves past its token here."""
    tokens, processed, allowed = picked.tokens, picked.processed, picked.allowed
    floats, ints = measure.chosen(logits, processed, tokens, how.top_n)
    step = assemble(index, floats, ints, list(active), how.top_n, kv)
    if allowed is not None and how.grammars is not None:
        rows = [g is not None and a for g, a in zip(how.grammars, active)]
        step.grammar, step.allowed = grammar.numbers(logits, allowed, tokens, rows), allowed
        moving = [r and n is not None and n["allowed"] > 0 for r, n in zip(rows, step.grammar)]
        grammar.accept(how.grammars, tokens, moving)
    if how.draft is not None:
        step.draft = [how.draft.record()]
    if not how.shared:
        for r, p in enumerate(how.params):
            n = p.top_logprobs
            step.top_ids[r], step.top_logprobs[r] = step.top_ids[r][:n], step.top_logprobs[r][:n]
            step.top_sampled_logprobs[r] = step.top_sampled_logprobs[r][:n]
    return step


def assemble(index: int, floats: list, ints: list, active: list[bool], n: int, kv: ledger.KVState) -> BatchStep:
    """A BatchStep from measure.chosen's rows of floats and ints."""
    return BatchStep(
        index=index,
        token_ids=[r[0] for r in ints],
        active=list(active),
        finish=[None] * len(ints),
        logprob=[r[0] for r in floats],
        sampled_logprob=[r[1] for r in floats],
        rank=[r[1] for r in ints],
        entropy=[r[2] for r in floats],
        sampled_entropy=[r[3] for r in floats],
        top_ids=[r[2 : 2 + n] for r in ints],
        top_logprobs=[r[4 : 4 + n] for r in floats],
        top_sampled_logprobs=[r[4 + n : 4 + 2 * n] for r in floats],
        kv=kv,
        time_ms=0.0,
    )


def nothing_allowed(step: BatchStep, how: Choosing, indices: Sequence[int] | None = None) -> dict:
    """{row: its InvalidParameter} for the rows whose grammar allowed no token at this step;
    `indices`: each row's own step number where rows are at different steps (else step.index)."""
    out = {}
    for row, numbers in enumerate(step.grammar or []):
        if numbers is not None and numbers["allowed"] == 0 and how.grammars is not None:
            name = how.grammars[row].name  # type: ignore[union-attr]
            at = step.index if indices is None else indices[row]
            out[row] = InvalidParameter(f"{name}: the grammar allows no token at step {at} (nothing can follow)")
    return out


def finish(step: BatchStep, eos_token_ids: Sequence[int], params: SamplingParams, on_token: TokenHook | None) -> None:
    """Sets the finish reason of every active row of `step` (one params for all rows)."""
    last = step.index == params.max_new_tokens - 1
    for row, token in enumerate(step.token_ids):
        if not step.active[row]:
            continue
        hit = on_token(row, token) if on_token is not None else False
        step.finish[row] = finish_reason(params.stop_on_eos and token in eos_token_ids, hit, last)
