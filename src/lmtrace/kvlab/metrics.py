"""The numbers of one step of one arm against the reference, and an arm's summary."""

from __future__ import annotations

import math
from typing import Any

import torch

from lmtrace.logits import measure


def step_numbers(ref_lp: torch.Tensor, arm_logits: torch.Tensor, token: int) -> dict[str, Any]:
    """`ref_lp` (vocab,) the reference's log-softmax, `arm_logits` (vocab,) float32 logits."""
    lp = torch.log_softmax(arm_logits, dim=-1)
    chosen = lp[token]
    p_ref = ref_lp.exp()
    kl = torch.sum(p_ref * (ref_lp - lp))  # KL(full || arm), in nats
    entropy_shift = measure.entropy(lp[None])[0] - measure.entropy(ref_lp[None])[0]
    numbers = torch.stack([chosen, chosen - ref_lp[token], kl.clamp(min=0.0), entropy_shift]).tolist()
    return {
        "logprob": numbers[0],
        "delta": numbers[1],
        "kl": numbers[2],
        "top1_agree": int(lp.argmax()) == token,
        "rank": int((lp > chosen).sum()) + 1,
        "entropy_shift": numbers[3],
    }


def evicted_mass(ref_weights: dict[int, torch.Tensor], ref_positions: list[torch.Tensor],
                 arm_positions: list[torch.Tensor]) -> float | None:  # fmt: skip
    """Mean over layers of the attention the reference's query put on positions this arm did
    not hold at the same pass (`ref_weights[layer]`: (1, ref slots))."""
    masses = []
    for layer, w in sorted(ref_weights.items()):
        if w.shape[-1] != ref_positions[layer].numel():
            continue  # a sliding layer's prefill attends to more than it keeps; no policy touches it
        missing = ~torch.isin(ref_positions[layer], arm_positions[layer])
        masses.append(float(w[0].cpu()[missing].sum()))
    return sum(masses) / len(masses) if masses else None


def summary(steps: list[dict[str, Any]], ref_bytes: list[int], divergence: int | None) -> dict[str, Any]:
    n = len(steps)
    if n == 0:
        return {"bytes_fraction": None, "mean_kl": None, "max_kl": None, "top1_agreement": None,
                "perplexity": None, "divergence_step": divergence}  # fmt: skip
    kls = [s["kl"] for s in steps]
    masses = [s["evicted_mass"] for s in steps if s.get("evicted_mass") is not None]
    nll = -sum(s["logprob"] for s in steps) / n
    return {
        "bytes_fraction": sum(s["bytes"] / r for s, r in zip(steps, ref_bytes) if r) / n,
        "mean_kl": sum(kls) / n,
        "max_kl": max(kls),
        "top1_agreement": sum(s["top1_agree"] for s in steps) / n,
        "perplexity": math.exp(nll) if nll < 700 else float("inf"),
        "divergence_step": divergence,
        "mean_delta": sum(s["delta"] for s in steps) / n,
        "mean_evicted_mass": sum(masses) / len(masses) if masses else None,
        "bytes_final": steps[-1]["bytes"],
        "bytes_max": max(s["bytes"] for s in steps),
    }
