"""Observers: what a decoding loop records at each step beside the chosen token's numbers.
The loop knows no option names: it hands every observer the prefill's logits once and each
step's logits, tokens and choosing rule, and an observer writes its own field of the BatchStep.

    Echo          the prompt's own tokens, teacher-forced in the prefill pass (`echo`)
    Waterfall     the distribution after each sampling stage at the selected steps (`waterfall`)
    inside.Probe  the logit lens and the attention over the cache (`lens`, `attention`)

Adding an observer: a class with the four members of `Observer` in the module that owns its
idea, and one line in `build` below."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from lmtrace.arguments import step_selector
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.inside.probe import Probe
from lmtrace.logits import measure, waterfall


class Observer(Protocol):
    # True: the prefill keeps the logits of every prompt position (batch, len, vocab)
    all_positions: bool

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        """Hooks around the generation's forwards (a null context when none are needed)."""

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The prefill's logits: (batch, len, vocab) with all_positions, else (batch, vocab)."""

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> None:
        """Step `step.index`: its raw `logits` (batch, vocab) and chosen `tokens` (batch,)."""


class Echo:
    """The prompt tokens' numbers from the prefill pass, on step 0 (`BatchStep.prompt`)."""

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

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> None:
        if step.index == 0:
            step.prompt = self.numbers


class Waterfall:
    """The distribution after each sampling stage, at the steps `at(index)` selects."""

    all_positions = False

    def __init__(self, at: Callable[[int], bool], top_n: int):
        self.at, self.top_n = at, top_n

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        pass

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> None:
        if self.at(step.index):
            step.waterfall = waterfall.stages(logits, how.params[0], how.batch_seen(), tokens, self.top_n, step.allowed)


class Inside:
    """The logit lens and the attention over the cache (inside/probe.py, Probe) at every step."""

    all_positions = False

    def __init__(self, probe: Probe):
        self.probe = probe

    def attached(self, model: Any) -> contextlib.AbstractContextManager:
        return self.probe.attached(model)

    def prefill(self, logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        pass

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> None:
        step.lens, step.attention = self.probe.take(step.index, logits, tokens)


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
