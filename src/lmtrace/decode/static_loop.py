"""The static batch with the whole step compiled (decode/static.py): engine.generate_steps's
loop, where each step's numbers are copied to the host while the next step runs and recorded
a step behind, as continuous batching measures a step beside the next forward. The first step
(the prefill's distribution) is the eager one; rows that ended on an end token are fed it on
the device, so no step waits for the host before the next is started."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from lmtrace.decode import engine, static
from lmtrace.decode.loop import Finish, Watch, advance, recorded
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.kv import ledger
from lmtrace.logits import processors, sampling
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
    seen = processors.seen_mask(params, prompt_ids, model.config.vocab_size, model.device)  # (batch, vocab)
    how = Choosing([params], rng, seen)
    length = static.capacity(width + params.max_new_tokens)
    full = torch.cat([mask, mask.new_ones((batch, length - width))], dim=-1) if padded else None  # (batch, length)
    compiled = static.step_for(model, params, params.top_logprobs)
    expected = engine.expected_bytes(model, batch)
    eos = torch.tensor(sorted(set(setup.eos_token_ids)), dtype=torch.long, device=model.device)
    watch = Watch(finish=Finish(setup.eos_token_ids, params, setup.on_token))
    active = [True] * batch
    started = time.perf_counter()
    with torch.inference_mode(), static.held_cache(model, batch, length) as cache:
        logits = engine.prefill(model, input_ids, mask if padded else None, cache)  # (batch, vocab)
        tokens, step = advance(0, logits, how, active, ledger.state(cache, expected, seen=width), watch)
        done = _ended(tokens, eos, torch.zeros(batch, dtype=torch.bool, device=model.device))
        step.time_ms = (time.perf_counter() - started) * 1000
        yield step
        active = [a and f is None for a, f in zip(active, step.finish)]
        positions = engine.positions(mask)[:, -1:] + 1  # (batch, 1)
        pending: Pending | None = None
        for index in range(1, params.max_new_tokens + 1):
            if index < params.max_new_tokens and any(active):
                how.saw(tokens)
                fed = torch.where(done, eos[0], tokens) if len(eos) else tokens  # ended rows: an end token
                out = compiled(fed, positions, full, cache, how.batch_seen(), how.rng)
                positions = positions + 1
                tokens, done = out.tokens, _ended(out.tokens, eos, done)
                launched = to_host(index, out)
            else:
                launched = None
            if pending is not None:  # the step before, recorded while this one runs
                kv = ledger.state(cache, expected, seen=width + pending.index)
                step = recorded(pending.index, *pending.lists(), how, active, kv, watch)
                step.time_ms, started = (time.perf_counter() - started) * 1000, time.perf_counter()
                yield step
                active = [a and f is None for a, f in zip(active, step.finish)]
            if launched is None or not any(active):
                return
            pending = launched


def _ended(tokens: torch.Tensor, eos: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """Rows that have chosen an end token by now (batch,) bool, on the device."""
    return done | torch.isin(tokens, eos) if len(eos) else done
