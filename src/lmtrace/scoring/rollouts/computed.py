"""The rollouts' logits under one computation: the reference's own model, or a stability
variant (lmtrace.scoring.variants.worlds) — the trainer's side (`--trainer`) and the variants the
causes try. A variant with a model of its own (dtype, packed weights, another file) or a
setting (attention kernel, threads) runs the batched path under it; one that is a way of
batching or compiling (batch:N, compile) runs its own teacher forcing, a rollout at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.scoring.rollouts import tokens
from lmtrace.scoring.rollouts.forward import forced_logits
from lmtrace.scoring.rollouts.rollout import Rollout
from lmtrace.scoring.variants import worlds as variants

OnLogits = Callable[[int, torch.Tensor], None]  # (rollout index, logits (n, vocab) float32)


def each(lm: LM, rollouts: Sequence[Rollout], on_logits: OnLogits, world: variants.World | None = None) -> None:
    """Calls on_logits for every rollout under `world` (None: the reference itself)."""
    if world is None:
        for i, logits in forced_logits(lm.model, rollouts, lm.pad_token_id):
            on_logits(i, logits)
        return
    if isinstance(world, (variants.BatchWorld, variants.CompiledWorld)):
        for i, r in enumerate(rollouts):
            on_logits(i, world.forced(r.prompt_ids + r.completion_ids, len(r.prompt_ids)))  # (n, vocab) log-probs
        return
    with world.scope():
        for i, logits in forced_logits(world.lm.model, rollouts, world.lm.pad_token_id or lm.pad_token_id):
            on_logits(i, logits)


def processed(
    lm: LM, rollouts: Sequence[Rollout], params: Sequence[SamplingParams], world: variants.World | None = None
) -> list[list[float]]:
    """Each rollout's processed logprobs under `world`."""
    out: list[list[float]] = [[] for _ in rollouts]

    def keep(i: int, logits: torch.Tensor) -> None:
        ids = torch.tensor(rollouts[i].completion_ids, device=logits.device)
        out[i] = tokens.raw_and_processed(logits, ids, params[i])[1].tolist()

    each(lm, rollouts, keep, world)
    return out
