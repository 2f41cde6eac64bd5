"""The stability ledger's arithmetic, over plain numbers (no torch): each variant's numbers
along the reference's tokens, the noise at each step, the risk that the token flips.

    margin  = the reference's top-1 minus top-2 raw logprob at the step (nats)
    change  = how much a variant moved that gap: (lp_v[top1] - lp_v[top2]) - (lp_0[top1] - lp_0[top2])
    level_v = the root-mean-square of variant v's changes over the reference's steps
    sigma   = the largest, over the variants, of max(|change| at the step, level_v)
    risk    = margin / sigma;  flagged: risk below the threshold (or an exact tie)

A variant's noise at a step is at least its usual noise along this reference (a step where it
happened to move the gap little is not a quiet step), and a spike above that counts as it is;
the largest over the variants, not a mean, so that adding a quiet variant (a thread count,
float32 everywhere) never hides a noisy one. Calibrated on the bundled model (55 prompts x 32
tokens, 8 CPU variants, the noise of each held-out variant's flips estimated from the others
only): threshold 2 catches 93% of the flips while flagging 9.7% of the steps; the per-step
largest change alone needed 5 for 91% (docs/stability.md, bench/stability_calibration.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

THRESHOLD = 2.0


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def variant_steps(
    logprob: Sequence[float],
    base: Sequence[float],
    top_ids: Sequence[int],
    reference_top: Sequence[int],
    change: Sequence[float | None],
) -> list[dict[str, Any]]:
    """Per step of one variant: its logprob of the reference token, the delta from the
    reference's, whether its top-1 differs from the reference's (`flipped`), the token it put
    first, and how much it moved the reference's top-1/top-2 gap (`margin_change`)."""
    return [
        {
            "index": i,
            "logprob": _finite(lp),
            "delta": _finite(lp - b),
            "flipped": t != r,
            "top_token_id": t,
            "margin_change": _finite(c),
        }
        for i, (lp, b, t, r, c) in enumerate(zip(logprob, base, top_ids, reference_top, change))
    ]


def variant_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """max and mean |delta|, the number of flips and the first flipped step."""
    deltas = [abs(s["delta"]) for s in steps if s["delta"] is not None]
    flips = [s["index"] for s in steps if s["flipped"]]
    return {
        "max_abs_delta": max(deltas) if deltas else None,
        "mean_abs_delta": sum(deltas) / len(deltas) if deltas else None,
        "flips": len(flips),
        "first_flip": flips[0] if flips else None,
    }


def level(changes: Sequence[float | None]) -> float | None:
    """A variant's usual noise along the reference: the root-mean-square of its changes."""
    seen = [c * c for c in changes if c is not None]
    return math.sqrt(sum(seen) / len(seen)) if seen else None


def sigma(changes: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Per step, the largest over the variants (`changes[v][i]`) of max(|change|, the
    variant's level); None where no variant measured the step."""
    levels = [level(c) for c in changes]
    n = max((len(c) for c in changes), default=0)
    out: list[float | None] = []
    for i in range(n):
        seen = [max(abs(c[i]), lv) for c, lv in zip(changes, levels) if i < len(c) and c[i] is not None]
        out.append(max(seen) if seen else None)
    return out


def is_flagged(margin: float | None, noise: float | None, threshold: float) -> bool:
    """A tie is always flagged; else the margin must clear `threshold` times the noise."""
    if margin is None:
        return False
    if margin <= 0.0:
        return True
    return noise is not None and margin < threshold * noise


def ledger(margins: Sequence[float | None], noise: Sequence[float | None], threshold: float) -> list[dict[str, Any]]:
    """The per-step rows: index, margin, sigma, risk (margin / sigma; null where sigma is 0 or
    unknown), flagged."""
    rows = []
    for i, m in enumerate(margins):
        s = noise[i] if i < len(noise) else None
        risk = m / s if m is not None and s else None
        rows.append({"index": i, "margin": m, "sigma": s, "risk": risk, "flagged": is_flagged(m, s, threshold)})
    return rows
