"""Branching: decode once, then again with the token at step `at` replaced by the K-th most
likely token under the raw distribution (K = 2 is the runner-up), continuing with the same
settings.

Every branch reuses the original's KV cache for the shared prefix: the cache is cropped back to
the prompt and the steps before `at`, and only the new tokens are fed. The raw distribution at
`at` is kept from the original run, so not even that position is recomputed. A sampled branch
continues with the random stream as it stood after the original's draw at `at`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace import arguments
from lmtrace.decode import branch_draft, engine, observers
from lmtrace.decode.loop import Finish, Watch, advance
from lmtrace.decode.rows import RowRecord, generator, make_params, records, seeded, to_trace
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.decode.tracing import encode_prompt
from lmtrace.errors import GenerationError, InvalidParameter
from lmtrace.inside import probe as inside
from lmtrace.kv import ledger
from lmtrace.logits import processors
from lmtrace.model.draft import draft_for
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
    probe: tuple | None = None  # the lens / attention captures of the forward behind `at`


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
    lm: LM, cache, at: _From, how: Choosing, hook: Callable[[int, int], bool], probe: inside.Probe | None
) -> Iterator[BatchStep]:
    """The decoding loop for one sequence from step `at.start`: the same steps as
    engine.generate_steps for a batch of one (decode/step.py's `take`)."""
    p, logits = how.params[0], at.logits
    eos = sorted(lm.eos_token_ids) if p.stop_on_eos else []
    watch = Watch(observers.build(probe), finish=Finish(eos, p, hook))
    expected = engine.expected_bytes(lm.model, 1)
    started = time.perf_counter()
    for index in range(at.start, p.max_new_tokens):
        forced = at.forced is not None and index == at.start
        how.forced = torch.tensor([at.forced], device=logits.device) if forced else None
        tokens, step = advance(index, logits, how, [True], ledger.state(cache, expected), watch)
        if at.fork is not None and index == at.fork[0]:  # the seen mask moves only at how.saw below
            _save(at.fork[1], logits, how, probe)
        step.time_ms = (time.perf_counter() - started) * 1000
        yield step
        if step.finish[0] is not None:
            return
        started = time.perf_counter()
        how.saw(tokens)
        position = torch.tensor([[at.prompt_len + index]], device=logits.device)
        logits = engine.decode_step(lm.model, tokens, position, None, cache)


def _save(fork: _Fork, logits: torch.Tensor, how: Choosing, probe: inside.Probe | None) -> None:
    """The fork point: the raw distribution, the penalty mask before this step's token, the
    random stream after its draw, the probe's captures."""
    seen = how.batch_seen()
    fork.logits, fork.seen = logits.clone(), None if seen is None else seen.clone()
    fork.rng_state = None if how.rng is None else how.rng.get_state()
    fork.probe = probe.snapshot() if probe is not None else None


def _crop(cache, length: int) -> None:
    """Cuts the cache back to its first `length` positions (public DynamicCache API; a negative
    count removes that many, which old and new 5.x releases both read the same way)."""
    extra = ledger.seq_length(cache) - length
    if extra > 0:
        try:
            cache.crop(-extra)
        except (RuntimeError, ValueError) as e:  # e.g. a sliding-window layer past its window
            raise GenerationError(f"branch: this model's cache cannot be cut back to {length} positions ({e})") from e


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
    """One prompt's original decoding and its branches, sharing one KV cache."""

    def __init__(
        self, lm: LM, prompt: str, p: SamplingParams, chat: bool, lens: bool = False, attention: bool | str = False
    ):
        self.lm, self.prompt, self.p, self.chat = lm, prompt, p, chat
        self.ids = encode_prompt(lm, prompt, chat)
        probe = inside.Probe([self.ids], p.top_logprobs, lens, attention)
        self.probe = probe if probe.wanted else None
        engine.check_context(lm.model, [self.ids], p)
        self.cache = ledger.new_cache(lm.model)
        self.eos = set(lm.eos_token_ids) if p.stop_on_eos else set()

    def _trace(self, make_steps: Callable, prefix: Sequence = ()) -> Trace:
        """A Trace from a _decode run; `prefix` holds the original's Steps before the branch point."""
        row = RowRecord(self.lm, self.p.stop)
        for s in prefix:  # replays the detokenizer; the original stopped at none of these tokens
            row.add(s.token_id, False)
        row.steps = [dataclasses.replace(s) for s in prefix]
        hook = lambda r, t: row.add(t, t in self.eos)  # noqa: E731
        for _ in records(self.lm, [self.ids], make_steps(hook), [row]):
            pass
        return to_trace(self.lm, self.prompt, self.ids, self.p, row, self.chat, probe=self.probe)

    def original(self, at: int) -> tuple[Trace, _Fork]:
        lm, p, fork = self.lm, self.p, _Fork()
        seen = processors.seen_mask(p, [self.ids], lm.model.config.vocab_size, lm.model.device)
        logits = engine.prefill(lm.model, torch.tensor([self.ids], device=lm.model.device), None, self.cache)
        rng, n = generator(lm, p), len(self.ids)
        start, how = _From(logits, 0, n, fork=(at, fork)), Choosing([p], rng, seen)
        trace = self._trace(lambda hook: _decode(lm, self.cache, start, how, hook, self.probe))
        return trace, fork

    def branch(self, original: Trace, fork: _Fork, at: int, token: int) -> Trace:
        _crop(self.cache, len(self.ids) + at)
        rng = None
        if fork.rng_state is not None:
            rng = torch.Generator(device=self.lm.model.device)
            rng.set_state(fork.rng_state)
        seen = None if fork.seen is None else fork.seen.clone()
        n = len(self.ids)
        if self.probe is not None:
            self.probe.restore(fork.probe, [self.ids + original.token_ids[:at]])

        start, how = _From(fork.logits, at, n, forced=token), Choosing([self.p], rng, seen)

        def make_steps(hook):
            return _decode(self.lm, self.cache, start, how, hook, self.probe)

        return self._trace(make_steps, prefix=original.steps[:at])


def branch(
    lm: LM,
    prompt: str,
    at: int,
    alternatives: Sequence[int] | None = None,
    *,
    fan: int | None = None,
    params: SamplingParams | None = None,
    chat: bool = False,
    lens: bool = False,
    attention: bool | str = False,
    draft: str | LM | Any | None = None,
    draft_tokens: int = 4,
    **kwargs: Any,
) -> Branches:
    """Decodes `prompt`, then once more per alternative rank K with the token at step `at`
    replaced by the K-th most likely raw token (default K = 2). `fan=K` branches on each of the
    K most likely tokens other than the one the original chose. `lens` and `attention` record
    inside each step as in lmtrace.generate; `draft` decodes the original and every branch
    speculatively (decode/branch_draft.py)."""
    p = seeded(make_params(params, "branch", **kwargs))
    check_integer("at", at, low=0, high=p.max_new_tokens - 1)
    if p.constraint is not None:  # a branch's forced token may be one the grammar refuses
        raise InvalidParameter(f"{p.constraint}: branch does not take a constraint (generate does)")
    ranks = _ranks(alternatives, fan, int(lm.model.config.vocab_size))
    if draft is not None:
        arguments.draft_tokens(draft_tokens)
        arguments.draft_alone(lens, attention)
        chosen = draft_for(lm, draft)
        ids = encode_prompt(lm, prompt, chat)
        with torch.inference_mode():
            traces, ranks = branch_draft.branches(lm, ids, prompt, at, ranks, fan is not None, p, chat, chosen,
                                                  draft_tokens)  # fmt: skip
        return Branches(at, [None, *ranks], traces)
    session = _Session(lm, prompt, p, chat, lens, attention)
    attached = session.probe.attached(lm.model) if session.probe is not None else contextlib.nullcontext()
    with torch.inference_mode(), attached:
        original, fork = session.original(at)
        if fork.logits is None:
            raise InvalidParameter(f"at must be a step the decoding reached (0..{len(original.steps) - 1}), got {at}")
        order = torch.topk(fork.logits[0], max(ranks)).indices.tolist()
        if fan is not None:  # the original's own token is the original, not a branch
            ranks = [k for k in ranks if order[k - 1] != original.steps[at].token_id]
        traces = [original] + [session.branch(original, fork, at, order[k - 1]) for k in ranks]
    return Branches(at, [None, *ranks], traces)
