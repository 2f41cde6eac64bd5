"""Pure functions over float32 logits (batch, vocab), in the documented order:
repetition penalty -> temperature -> top-k -> top-p -> min-p (transformers' order).

Each filter writes -inf where it removes a token and keeps at least one token, exactly as
transformers' RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper and MinPLogitsWarper do (the tests check against them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmtrace.params import SamplingParams

NEG_INF = float("-inf")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """`seen` is a (batch, vocab) bool mask of the tokens in each sequence so far."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    # a tiny penalty can push a logit past float32's range: +inf would make the softmax NaN
    penalized = penalized.clamp(max=torch.finfo(penalized.dtype).max)
    return torch.where(seen, penalized, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature in (0.0, 1.0):
        return logits
    out = logits / temperature
    if (torch.isposinf(out) | torch.isnan(out)).any():
        # a temperature so small that logits overflow float32 (or that is 0 in float32): the
        # same distribution from logits shifted to a maximum of 0 (a softmax ignores a shift),
        # divided in float64; what stays below the maximum goes to -inf, as in the limit
        shifted = logits.double() - logits.amax(dim=-1, keepdim=True).double()
        out = (shifted / temperature).to(logits.dtype)
    return out


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (batch, 1)
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    # min_p <= 1, so the most likely token always survives: no extra keep-one step is needed
    remove = probs < threshold
    return logits.masked_fill(remove, NEG_INF)


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """The distribution a token is chosen from, as logits. Greedy applies only the penalty."""
    out = logits
    if params.repetition_penalty != 1.0 and seen is not None:
        out = apply_repetition_penalty(out, seen, params.repetition_penalty)
    if params.greedy:
        return out
    out = apply_temperature(out, params.temperature)
    out = apply_top_k(out, params.top_k)
    out = apply_top_p(out, params.top_p)
    return apply_min_p(out, params.min_p)


# one generator for the whole batch, or one per row (a list, indexed by row)
Rng = torch.Generator | Sequence[torch.Generator] | None


def choose(processed: torch.Tensor, params: SamplingParams, rng: Rng) -> torch.Tensor:
    """Token ids (batch,): argmax for greedy, else a draw from softmax(processed) with `rng`.
    With one generator per row each row draws alone, so a seeded row picks the same tokens
    whichever rows share its batch."""
    if params.greedy:
        return processed.argmax(dim=-1)
    probs = torch.softmax(processed, dim=-1)
    if isinstance(rng, Sequence):
        if len(rng) != probs.shape[0]:
            raise ValueError(f"rng: one generator per row is needed, got {len(rng)} for {probs.shape[0]} rows")
        rows = [torch.multinomial(probs[r : r + 1], num_samples=1, generator=g) for r, g in enumerate(rng)]
        return torch.cat(rows).squeeze(-1)  # (batch, 1) -> (batch,)
    return torch.multinomial(probs, num_samples=1, generator=rng).squeeze(-1)
