"""Observers: what a decoding loop records at each step beside the chosen token's numbers.
The loop knows no option names: it hands every observer the prefill's logits once and each
step's logits, tokens and choosing rule, and an observer writes its own field of the BatchStep.

    Echo          the prompt's own tokens, teacher-forced in the prefill pass (`echo`)
    Waterfall     the distribution after each sampling stage at the selected steps (`waterfall`)
    inside.Probe  the logit lens and the attention over the cache (`lens`, `attention`)

Adding an observer: a subclass of `Observer` in the module that owns its idea, returning its
entry from `observe` (a record field of its own needs none), and one line in `build` below (or
passed by the caller: `observers=[...]`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lmtrace.arguments import step_selector
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.errors import InvalidParameter
from lmtrace.inside.probe import Probe
from lmtrace.logits import measure, waterfall
from lmtrace.records import Step


class Observer:
    """Something recorded at each decoding step beside the chosen token's numbers; public: pass
    instances as `lmtrace.generate(lm, prompt, observers=[...])`. Subclass it and override what
    you need:

        class Top1Margin(lmtrace.Observer):
            name = "margin"                        # the entry: step.margin, "margin" in the JSON
            def observe(self, step, logits, tokens, how):
                top2 = logits.float().log_softmax(-1).topk(2).values  # (batch, 2)
                return (top2[:, 0] - top2[:, 1]).tolist()             # one entry per row

    The loop hands every observer the prefill's logits once and, at each step, the raw logits
    (batch, vocab), the chosen tokens (batch,) and the choosing rule (`how.params[row]`). What
    `observe` returns (one JSON-able entry per row, None for a row without one; None: nothing at
    this step) is the step's entry under `name`; `summarize(steps)` returns the trace's entry under
    the same name (None: none). An observer that writes a BatchStep field of its own (the built-in
    lens, attention, waterfall, echo) returns None."""

    name: str = ""
    # True: the prefill keeps the logits of every prompt position (batch, len, vocab)
    all_positions: bool = False

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        """Hooks around the generation's forwards (a null context when none are needed)."""
        return contextlib.nullcontext()

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The prefill's logits: (batch, len, vocab) with all_positions, else (batch, vocab)."""

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> list[Any] | None:
        """Step `step.index`: its raw `logits` (batch, vocab) and chosen `tokens` (batch,)."""
        return None

    def observe_rows(
        self,
        step: BatchStep,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        how: Choosing,
        rows: Sequence[int],
        indices: Sequence[int],
    ) -> list[Any] | None:
        """`observe` in a batch of rows at different steps (continuous batching): `rows` are the
        rows that asked for this observer, `indices` every row's own step number. The default
        observes the whole batch (the other rows' entries are dropped)."""
        return self.observe(step, logits, tokens, how)

    def summarize(self, steps: list[Step]) -> Any:
        """The trace's entry from a finished row's steps (None: no trace-level entry)."""
        return None

    def snapshot(self) -> Any:
        """What this observer keeps of the last forward (its hooks' captures), for a branch that
        starts from this step without computing it again (lmtrace.branch); None: nothing."""
        return None

    def restore(self, saved: Any, seqs: Sequence[Sequence[int]]) -> None:
        """Back to a `snapshot`, each row's tokens so far `seqs`."""

    def start(self, prompt_ids: Sequence[Sequence[int]]) -> None:
        """A generation over these prompts starts (with a draft, the prompts of a batch decode one
        after another, each its own generation)."""

    def positions(self, n: int) -> None:
        """The next forward computes `n` steps at once (a speculative block's verify forward):
        hooks that keep what a forward left keep its last `n` positions."""

    def select(self, at: int) -> None:
        """The step observed next is the kept position `at` (0: the first) of the last forward."""


def summaries(observers: Sequence[Observer], steps: list[Step]) -> dict[str, Any]:
    """The trace-level entries of a finished row: {name: summary} for every observer that has one."""
    out = {}
    for observer in observers:
        summary = observer.summarize(steps)
        if summary is not None:
            out[observer.name] = summary
    return out


def checked(observers: Sequence[Any]) -> list[Observer]:
    """The user's observers checked: each an Observer with a name of its own that no record
    field already has."""
    out, names = [], set()
    for o in observers:
        if not isinstance(o, Observer):
            raise InvalidParameter(f"observers: each must be an lmtrace.Observer, got {type(o).__name__}")
        if not o.name or o.name in Step.__dataclass_fields__ or o.name in BUILT_IN or o.name in names:
            raise InvalidParameter(f"observers: name must be set, new and unique, got {o.name!r}")
        names.add(o.name)
        out.append(o)
    return out


class Echo(Observer):
    """The prompt tokens' numbers from the prefill pass, on step 0 (the entry `prompt`)."""

    name = "prompt"
    all_positions = True

    def __init__(self, top_n: int):
        self.top_n = top_n
        self.numbers: list[measure.Forced] = []

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Each row's prompt, left padding skipped; a row's first token has no prediction."""
        self.numbers = []
        for row in range(input_ids.shape[0]):
            start = int((mask[row] == 0).sum())  # left padding
            self.numbers.append(measure.targets(logits[row, start:-1], input_ids[row, start + 1 :], self.top_n))

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor,
                how: Choosing) -> list[measure.Forced] | None:  # fmt: skip
        return self.numbers if step.index == 0 else None


class Waterfall(Observer):
    """The distribution after each sampling stage, at the steps `at(index)` selects."""

    name = "waterfall"
    all_positions = False

    def __init__(self, at: Callable[[int], bool], top_n: int):
        self.at, self.top_n = at, top_n

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        pass

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> list | None:
        if not self.at(step.index):
            return None
        return waterfall.stages(logits, how.params[0], how.batch_seen(), tokens, self.top_n, step.allowed,
                                how.user, how.history)  # fmt: skip

    def observe_rows(
        self,
        step: BatchStep,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        how: Choosing,
        rows: Sequence[int],
        indices: Sequence[int],
    ) -> list | None:
        """Each asking row's waterfall at its own selected steps, under its own params, penalty,
        grammar and processors (each row of a continuous batch as alone)."""
        out: list = [None] * len(tokens)
        for r in rows:
            if not self.at(indices[r]):
                continue
            one = slice(r, r + 1)
            constrained = step.allowed is not None and how.grammars is not None and how.grammars[r] is not None
            history = how.history[one] if how.history is not None else None
            params = how.params[0 if how.shared else r]
            out[r] = waterfall.stages(
                logits[one],
                params,
                how.seen_of(r),
                tokens[one],
                self.top_n,
                step.allowed[one] if constrained else None,
                how.user_of(r),
                history,
            )[0]
        return out if any(e is not None for e in out) else None


class Inside(Observer):
    """The logit lens and the attention over the cache (inside/probe.py, Probe) at every step."""

    name = "inside"
    all_positions = False

    def __init__(self, probe: Probe):
        self.probe = probe

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        return self.probe.attached(model)

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        pass

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> list | None:
        return inside_entry(*self.probe.take(step.index, logits, tokens))

    def snapshot(self) -> Any:
        return self.probe.snapshot()

    def restore(self, saved: Any, seqs: Sequence[Sequence[int]]) -> None:
        self.probe.restore(saved, seqs)

    def start(self, prompt_ids: Sequence[Sequence[int]]) -> None:
        self.probe.rebase(prompt_ids)

    def positions(self, n: int) -> None:
        self.probe.positions(n)

    def select(self, at: int) -> None:
        self.probe.select(at)


# the entries the built-in observers write (records.Step keeps them as fields of their own)
BUILT_IN = (Echo.name, Waterfall.name, Inside.name)


def inside_entry(lens_rows: list | None, attention_rows: list | None) -> list | None:
    """One `inside` entry per row, {lens, attention}, from the rows' lens and attention records
    (None for a row with neither; None when no row has any)."""
    if lens_rows is None and attention_rows is None:
        return None
    n = len(lens_rows if lens_rows is not None else attention_rows)  # type: ignore[arg-type]
    lens_rows, attention_rows = lens_rows or [None] * n, attention_rows or [None] * n
    return [None if lens is None and att is None else {"lens": lens, "attention": att}
            for lens, att in zip(lens_rows, attention_rows)]  # fmt: skip


def build(
    probe: Probe | None = None, *, echo: bool = False, waterfall: int | str | None = None, max_new_tokens: int = 0,
    top_n: int = 0,
) -> list[Observer]:  # fmt: skip
    """The observers a generation asked for: the one registration of every observer."""
    out: list[Observer] = []
    if echo:
        out.append(Echo(top_n))
    selector = step_selector(waterfall, max_new_tokens)
    if selector is not None:
        out.append(Waterfall(selector, top_n))
    if probe is not None and probe.wanted:
        out.append(Inside(probe))
    return out


@contextlib.contextmanager
def attached(observers: Sequence[Observer], model: Any) -> Iterator[None]:
    """Every observer's hooks, for the duration of a generation."""
    with contextlib.ExitStack() as stack:
        for o in observers:
            stack.enter_context(o.attached(model))
        yield
