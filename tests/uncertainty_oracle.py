"""The hand computation the uncertainty scores are checked against: transformers' own logits,
step by step with its cache (model(...).logits), log_softmax in float32, every score written
out in float64 from its definition (DESIGN.md, LM-Polygraph, DeepConf) with no lmtrace code."""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache


def step_logits(model, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' raw logits (T, vocab) before each of `tokens`, fed one at a time (the
    prefill keeping only the last position's logits, as model.generate does)."""
    cache = DynamicCache()
    out = []
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits[:, -1]
        for token in tokens:
            out.append(logits[0].float())
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.stack(out)


def token_scores(lp: torch.Tensor, token: int, k: int) -> dict[str, float]:
    """One distribution's per-token scores, by hand: lp (vocab,) float32 logprobs."""
    values = [float(v) for v in lp.double().tolist() if math.isfinite(v)]
    ranked = sorted(values, reverse=True)
    top = ranked[:k]
    own = float(lp[token])
    if own < top[-1]:  # DeepConf counts the chosen token beside the top-k
        top = [*top, own]
    p = [math.exp(v) for v in values]
    h = -sum(pi * v for pi, v in zip(p, values))
    varentropy = sum(pi * v * v for pi, v in zip(p, values)) - h * h
    margin = ranked[0] - ranked[1] if len(ranked) > 1 else None
    return {"confidence": -sum(top) / len(top), "margin": margin, "varentropy": varentropy, "entropy": h}


def distances(lp: torch.Tensor) -> dict[str, float]:
    """LM-Polygraph's token terms: Rényi (alpha 0.5) and Fisher-Rao to uniform at temperature 2."""
    q = torch.softmax(lp.double() / 2, dim=-1)
    v = q.shape[-1]
    renyi = math.log(float((q**0.5).sum())) / (0.5 - 1) + math.log(v)
    fisher = 2 / math.pi * math.acos(float(q.sqrt().sum()) * math.sqrt(1 / v))
    return {"renyi": renyi, "fisher_rao": fisher}


def deepconf(conf: list[float], window: int, tail: int) -> dict[str, float]:
    """DeepConf's trace confidences, by hand from their definitions."""
    w = min(window, len(conf))
    groups = [sum(conf[i - w + 1 : i + 1]) / w for i in range(w - 1, len(conf))]
    low = sorted(groups)[: math.ceil(len(groups) / 10)]
    t = min(tail, len(conf))
    return {"mean": sum(conf) / len(conf), "bottom10": sum(low) / len(low), "lowest_group": min(groups),
            "tail": sum(conf[-t:]) / t}  # fmt: skip
