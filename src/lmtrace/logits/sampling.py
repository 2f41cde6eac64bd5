"""Choosing a token from processed logits: the argmax, or a draw with the row's generator.
The processing itself is lmtrace.logits.processors (the one ordered list)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmtrace.logits import processors
from lmtrace.params import SamplingParams


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None,
    user: Sequence[processors.UserProcessor] = (),
    history: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The distribution a token is chosen from, as logits: the processors in their one order
    (lmtrace.logits.processors). Greedy applies only the logit bias and the penalty (and the user's
    processors)."""
    return processors.process(logits, params, seen, processors.ORDER, user, history)


# one generator for the whole batch, or one per row (a list, indexed by row)
Rng = torch.Generator | Sequence[torch.Generator] | None


def choose(processed: torch.Tensor, params: SamplingParams, rng: Rng) -> torch.Tensor:
    """Token ids (batch,): argmax for greedy, else a draw from softmax(processed) with `rng`.
    With one generator per row each row draws alone, so a seeded row picks the same tokens
    whichever rows share its batch."""
    if params.greedy:  # argmax: the first of the largest, as max's index (three times faster on a CPU)
        return processed.max(dim=-1).indices
    probs = torch.softmax(processed, dim=-1)
    if isinstance(rng, Sequence):
        if len(rng) != probs.shape[0]:
            raise ValueError(f"rng: one generator per row is needed, got {len(rng)} for {probs.shape[0]} rows")
        rows = [torch.multinomial(probs[r : r + 1], num_samples=1, generator=g) for r, g in enumerate(rng)]
        return torch.cat(rows).squeeze(-1)  # (batch, 1) -> (batch,)
    return torch.multinomial(probs, num_samples=1, generator=rng).squeeze(-1)
