"""Why a rollout's engine logprobs disagree with the teacher-forced ones, each cause with the
figures that support it. A fit is the mean |engine − candidate| over the rollout's tokens; a
candidate explains the rollout when it fits at most FIT times the aligned fit (the engine
against the processed logprobs of the same ids). The checks, in order, first match wins:

- clean: the aligned fit is within float32 noise (CLEAN_MEAN, CLEAN_MAX): no cause;
- `off_by_one`: the engine's logprobs fit the ids shifted by one position;
- `processing_mismatch`: they fit another processing — `raw_reported` (no processing at all,
  with several steps on), the one step missing (`temperature`, `top_k`, `top_p`, `min_p`), or
  a temperature the settings do not say (`temperature`);
- `retokenized` (lmtrace.scoring.rollouts.probes): they fit the prompt as its own text
  tokenizes, where the record's ids differ from it (a sampled split that differs is normal:
  only a misfit that the text's own tokenization removes is labelled); or, with the detail
  `completion: positions ...` (lmtrace.scoring.rollouts.respelled), they fit another split of the
  completion's own text (the engine's ids decoded and encoded again, its logprobs kept);
- `numeric`: aligned, and a dtype/batch variant fits, or the misfit has that variant's own
  noise's size (the detail names it);
- `weights`: aligned, and no variant explains it (stale or different weights)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

CLEAN_MEAN = 1e-3  # nats: float32 teacher forcing against float32 decoding differs by ~1e-6
CLEAN_MAX = 2e-2
FIT = 0.2  # a candidate explains the misfit when it leaves at most this share of it
NUMERIC_FIT = 0.5  # a variant explains it when it leaves at most this share, or when
NOISE_SCALE = 3.0  # the misfit is within this many times the variant's own noise
MISS = 30.0  # nats: the gap counted for a token the candidate's processing removes


def gaps(engine: Sequence[float], other: Sequence[float]) -> list[float]:
    """|engine − other| per token (MISS where other is −inf)."""
    return [abs(e - o) if o != -math.inf else MISS for e, o in zip(engine, other)]


def fit(engine: Sequence[float], other: Sequence[float]) -> float:
    g = gaps(engine, other)
    return math.fsum(g) / len(g) if g else 0.0


def clean(engine: Sequence[float], processed: Sequence[float]) -> bool:
    g = gaps(engine, processed)
    return not g or (math.fsum(g) / len(g) <= CLEAN_MEAN and max(g) <= CLEAN_MAX)


def cause(name: str, detail: str | None, evidence: dict[str, Any]) -> dict[str, Any]:
    return {"cause": name, "detail": detail, "evidence": evidence}


def off_by_one(engine: Sequence[float], processed: Sequence[float]) -> dict[str, Any] | None:
    """The engine's logprob i belongs to the id at i + 1 (ids behind) or i − 1 (ids ahead)."""
    n = len(engine)
    if n < 3:
        return None
    ahead = fit(engine[:-1], processed[1:])  # engine[i] fits processed[i + 1]
    behind = fit(engine[1:], processed[:-1])  # engine[i] fits processed[i - 1]
    aligned = fit(engine, processed)
    best = min(ahead, behind)
    if best > FIT * aligned:
        return None
    evidence = {"aligned_fit": aligned, "shifted_fit": best, "shift": 1 if ahead <= behind else -1, "tokens": n - 1}
    return cause(
        "off_by_one", "logprob i is the id at i + 1" if ahead <= behind else "logprob i is the id at i - 1", evidence
    )


def processing(
    engine: Sequence[float],
    processed: Sequence[float],
    on: Sequence[str],
    alternatives: dict[str, list[float]],
    temperature: tuple[float, float] | None,
    said: float,
) -> dict[str, Any] | None:
    """Another processing than the settings say fits the engine's logprobs."""
    aligned = fit(engine, processed)
    fits = {name: fit(engine, values) for name, values in alternatives.items()}
    best = min(fits, key=fits.get) if fits else None
    if best is not None and fits[best] <= FIT * aligned:
        if best == "raw":
            detail = on[0] if len(on) == 1 else "raw_reported"
        else:
            detail = best.removeprefix("without_")
        return cause(
            "processing_mismatch", detail, {"aligned_fit": aligned, "fits": fits, "best": best, "steps_on": list(on)}
        )
    if temperature is not None:
        t, gap = temperature
        if gap <= FIT * aligned and abs(t - said) > 0.01 * said:
            return cause(
                "processing_mismatch",
                "temperature",
                {"aligned_fit": aligned, "fitted_temperature": t, "fitted_fit": gap, "temperature": said},
            )
    return None


def numeric_or_weights(aligned: float, variant_fits: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Aligned and unexplained so far. A variant explains the misfit when it fits the engine at
    most NUMERIC_FIT times the aligned fit (the engine computes what the variant does), or when
    the misfit has the size of the variant's own noise (how far the variant moves the reference's
    numbers), within a factor NOISE_SCALE: two computations in bfloat16 each move the numbers by
    their own rounding, so an engine in bfloat16 need not fit a bfloat16 teacher forcing, only be
    as far from float32 as it is. The detail: the best exact fit, else the variant whose noise is
    nearest the misfit; none: weights."""
    evidence: dict[str, Any] = {"aligned_fit": aligned, "variants": {k: dict(v) for k, v in variant_fits.items()}}
    exact = [k for k, v in variant_fits.items() if v["fit"] <= NUMERIC_FIT * aligned]
    sized = [
        k
        for k, v in variant_fits.items()
        if v["noise"] > 0 and v["noise"] / NOISE_SCALE <= aligned <= NOISE_SCALE * v["noise"]
    ]
    if exact:
        best = min(exact, key=lambda k: variant_fits[k]["fit"])
    elif sized:
        best = min(sized, key=lambda k: abs(math.log(aligned / variant_fits[k]["noise"])))
    else:
        return cause("weights", None, evidence)
    evidence["best_variant"] = best
    evidence["by"] = "fit" if exact else "noise"
    return cause("numeric", best, evidence)


def tally(per_rollout: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """[{cause, sequences}]: how many rollouts carry each cause, most first."""
    counts: dict[str, int] = {}
    for causes in per_rollout:
        for c in {c["cause"] for c in causes}:
            counts[c] = counts.get(c, 0) + 1
    return [{"cause": k, "sequences": v} for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
