"""The static batch with the whole step compiled (decode/static.py), a source of decode/loop.py's
one loop (`Fed.measured`), where each step's numbers are copied to the host while the next step runs and recorded
a step behind, as continuous batching measures a step beside the next forward. The first step
(the prefill's distribution) is the eager one; rows that ended on an end token are fed it on
the device, so no step waits for the host before the next is started."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from lmtrace.decode import engine, static
from lmtrace.decode.choosing import Rows, choosing
from lmtrace.decode.loop import Fed, Finish, Watch, drive
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.kv import ledger
from lmtrace.logits import sampling
from lmtrace.params import SamplingParams


@dataclass
class Pending:
    """A step in flight: its index, its numbers on their way to the host, the event they wait on."""

    index: int
    floats: torch.Tensor
    ints: torch.Tensor
    ready: torch.cuda.Event | None

    def lists(self) -> tuple[list, list]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.floats.tolist(), self.ints.tolist()


def to_host(index: int, out: static.Out) -> Pending:
    """The step's numbers copied to pinned host memory without waiting (on a CPU: as they are)."""
    if out.floats.device.type != "cuda":
        return Pending(index, out.floats, out.ints, None)
    floats = torch.empty(out.floats.shape, dtype=out.floats.dtype, pin_memory=True)
    ints = torch.empty(out.ints.shape, dtype=out.ints.dtype, pin_memory=True)
    floats.copy_(out.floats, non_blocking=True)
    ints.copy_(out.ints, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Pending(index, floats, ints, ready)


def generate_steps(
    model, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, rng: sampling.Rng, setup: engine.Setup
) -> Iterator[BatchStep]:
    """engine.generate_steps with the whole step compiled (no observers, grammar or user
    processors: static.whole_step); the same BatchSteps, the numbers within 5e-5."""
    engine.check_context(model, prompt_ids, params)
    batch = len(prompt_ids)
    input_ids, mask = engine.left_pad(prompt_ids, setup.pad_token_id, model.device)  # (batch, width)
    width, padded = input_ids.shape[1], bool((mask == 0).any())
    how = choosing(Rows([params], rng, prompt_ids), model)  # the penalty's seen tokens (batch, vocab)
    length = static.capacity(width + params.max_new_tokens)
    full = torch.cat([mask, mask.new_ones((batch, length - width))], dim=-1) if padded else None  # (batch, length)
    watch = Watch(finish=Finish(setup.eos_token_ids, params, setup.on_token))
    started = time.perf_counter()
    with torch.inference_mode(), static.held_cache(model, batch, length) as cache:
        logits = engine.prefill(model, input_ids, mask if padded else None, cache)  # (batch, vocab)
        source = Compiled(model, how, watch, cache, setup)
        source.feeding(logits, full, engine.positions(mask)[:, -1:] + 1, width)
        for _, step in drive(source, started):
            yield step


class Compiled:
    """The compiled static batch as the loop's source (decode/loop.py): the first step is the
    prefill's distribution, chosen by the loop; every later one is chosen and measured in the
    compiled graph (static.step_for), its numbers copied to the host while the next one runs and
    handed to the loop a step behind (`Fed.measured`: it cannot be an ordinary step, whose logits
    the loop chooses from, without waiting for the host at every step). Rows that ended on an end
    token are fed it on the device."""

    def __init__(self, model, how: Choosing, watch: Watch, cache, setup: engine.Setup):
        self.model, self.how, self.watch, self.cache = model, how, watch, cache
        self.params = how.params[0]
        self.compiled = static.step_for(model, self.params, self.params.top_logprobs)
        self.eos = torch.tensor(sorted(set(setup.eos_token_ids)), dtype=torch.long, device=model.device)
        self.index, self.ending = 0, False
        self.pending: Pending | None = None  # the step in flight
        self.unseen: torch.Tensor | None = None  # tokens the penalty has not marked yet (the graph's)

    def feeding(self, logits: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, width: int) -> None:
        """The prefill's logits (batch, vocab), the mask of the cache's length (None: no padding),
        the next positions (batch, 1), the prompt's width."""
        self.logits, self.mask, self.positions, self.width = logits, mask, positions, width
        self.active = [True] * len(logits)
        self.done = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)  # rows past an end token
        self.expected = engine.expected_bytes(self.model, len(logits))

    def next(self) -> Fed | None:
        if self.index == 0:
            kv = ledger.state(self.cache, self.expected, seen=self.width)
            return Fed(0, self.logits, self.how, self.active, kv, self.watch)
        while not self.ending:
            launched = self._launch() if self.index < self.params.max_new_tokens and any(self.active) else None
            self.index += 1
            pending, self.pending = self.pending, launched
            if pending is not None:  # the step before, recorded while this one runs
                kv = ledger.state(self.cache, self.expected, seen=self.width + pending.index)
                return Fed(pending.index, None, self.how, self.active, kv, self.watch, measured=pending.lists())
            self.ending = launched is None or not any(self.active)
        return None

    def _launch(self) -> Pending:
        """The compiled step `index` started from the last tokens; its numbers on their way."""
        if self.unseen is not None:
            self.how.saw(self.unseen)
        fed = torch.where(self.done, self.eos[0], self.tokens) if len(self.eos) else self.tokens  # ended rows
        out = self.compiled(fed, self.positions, self.mask, self.cache, self.how.batch_seen(), self.how.rng)
        self.positions = self.positions + 1
        self.tokens, self.unseen, self.done = out.tokens, out.tokens, _ended(out.tokens, self.eos, self.done)
        return to_host(self.index, out)

    def chose(self, tokens: torch.Tensor, step: BatchStep) -> None:
        if step.index == 0:  # the loop chose it (and marks it seen)
            self.tokens, self.done = tokens, _ended(tokens, self.eos, self.done)

    def took(self, tokens: torch.Tensor, step: BatchStep | None) -> None:
        self.active = [a and f is None for a, f in zip(self.active, step.finish)]
        if step.index == 0:
            self.index = 1
        else:
            self.ending = self.pending is None or not any(self.active)


def _ended(tokens: torch.Tensor, eos: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """Rows that have chosen an end token by now (batch,) bool, on the device."""
    return done | torch.isin(tokens, eos) if len(eos) else done
