"""Summary figures of a comparison and the verdict: do the engine's numbers look like the raw
distribution, a processed one (temperature, filtering), or is it unclear?"""

from __future__ import annotations

import math
from typing import Any

import torch

TEMPERATURES = [round(0.1 * 1.1**k, 4) for k in range(36)]  # 0.1 .. ~2.8, 10% apart


def fit_temperature(rows: torch.Tensor, chosen: torch.Tensor, engine: list[float | None]) -> dict[str, float] | None:
    """The temperature whose distribution best explains the engine's logprobs (mean |diff|)."""
    keep = [i for i, lp in enumerate(engine) if lp is not None and math.isfinite(lp)]
    if not keep:
        return None
    target = torch.tensor([engine[i] for i in keep], dtype=torch.float32)
    picked = rows[keep]
    ids = chosen[keep][:, None]

    def error(t: float) -> float:
        lp = torch.log_softmax(picked / t, -1).gather(-1, ids)[:, 0]
        return float((lp - target).abs().mean())

    coarse = min(TEMPERATURES + [1.0], key=error)
    fine = [round(coarse * (1 + k / 100), 4) for k in range(-10, 11)]  # 1% steps around the best
    best = min(fine + [1.0], key=error)
    return {"temperature": best, "mean_abs_diff": error(best)}


def judge(
    records: list[dict[str, Any]],
    engine: list[float | None],
    threshold: float,
    fit: dict[str, float] | None,
    processed: bool = False,
) -> dict[str, Any]:
    diffs = [abs(r["diff"]) for r in records if r["diff"] is not None and math.isfinite(r["diff"])]
    proc = [
        abs(r["engine_logprob"] - r["model_processed_logprob"])
        for r in records
        if r["engine_logprob"] is not None and math.isfinite(r["model_processed_logprob"])
    ]
    kls = [r["kl_top"] for r in records if r["kl_top"] is not None]
    mean_raw = sum(diffs) / len(diffs) if diffs else None
    mean_proc = sum(proc) / len(proc) if proc and processed else None
    first = next((r["index"] for r in records if r["diff"] is not None and abs(r["diff"]) > threshold), None)
    summary = {
        "compared": len(records),
        "top1_agreement": sum(r["engine_top1"] for r in records) / len(records) if records else None,
        "mean_abs_diff": mean_raw,
        "max_abs_diff": max(diffs) if diffs else None,
        "mean_abs_diff_processed": mean_proc,
        "frac_above_threshold": sum(d > threshold for d in diffs) / len(diffs) if diffs else None,
        "threshold": threshold,
        "mean_kl_top": sum(kls) / len(kls) if kls else None,
        "kl_note": "KL(engine || model) over the engine's reported alternatives, both renormalised to that set",
        "first_large_divergence": first,
        "best_temperature": fit,
    }
    summary["verdict"], summary["reason"] = _verdict(mean_raw, mean_proc, fit, threshold)
    return summary


def _verdict(raw: float | None, proc: float | None, fit: dict | None, threshold: float) -> tuple[str, str]:
    if raw is None:
        return "unclear", "no token could be compared"
    if proc is not None:  # settings were given: which distribution explains the numbers better?
        if proc < raw and proc <= threshold:
            return "processed", f"the processed distribution fits better ({proc:.4f} vs {raw:.4f} nats)"
        if raw <= proc and raw <= threshold:
            return "raw", f"the raw distribution fits better ({raw:.4f} vs {proc:.4f} nats)"
    if fit is not None and abs(fit["temperature"] - 1.0) > 0.05 and fit["mean_abs_diff"] < 0.5 * raw:
        return "processed", (
            f"temperature {fit['temperature']:.2f} explains the numbers "
            f"({fit['mean_abs_diff']:.4f} vs {raw:.4f} nats raw)"
        )
    if raw <= threshold:
        return "raw", f"mean |difference| {raw:.4f} nats against the raw distribution"
    return "unclear", f"mean |difference| {raw:.4f} nats; neither raw nor a temperature explains it"
