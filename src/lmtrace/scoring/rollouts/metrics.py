"""The summary metrics as the RL frameworks name them, over every token of every rollout, with
d = engine − trainer logprob and ratio = exp(trainer − engine) (π_trainer / π_engine):

- `k1` = mean d, `k2` = mean d²/2, `k3` = mean(exp(−d) + d − 1): the estimators of
  KL(engine ‖ trainer) over tokens drawn from the engine (verl `mismatch_kl`, `mismatch_k3_kl`);
- `mean_abs_delta` = mean |d| (TRL `sampling_logp_difference/mean`);
- `ppl_ratio` = the mean over sequences of exp(mean_t d): the trainer's perplexity over the
  engine's, per sequence first (verl `mismatch_ppl_ratio`);
- `outside_0_9_1_1`: the share of tokens whose ratio lies outside [0.9, 1.1] (verl #6280);
- `bitwise_equal`: every engine logprob equals the trainer's bit for bit (slime's "true
  on-policy": a batch-invariant engine and trainer, `lmtrace rollouts --batch-invariant`);
- per cap C: `tokens_clipped` (ratio > C: token TIS truncates them), `tokens_masked` (ratio
  outside [1/C, C]: token MIS drops them) and `sequences_masked` (the sequence's ratio, the
  geometric mean exp(mean_t log ratio) — a mean over its tokens, not a sum (TRL #5814) —
  outside [1/C, C]).

A token the trainer's processing removes (trainer logprob −inf) has ratio 0: it counts as
outside and masked, and is left out of the means of d (`tokens_impossible` says how many)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _mean(xs: Sequence[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def summary(rows: Sequence[Sequence[tuple[float, float]]], caps: Sequence[float]) -> dict[str, Any]:
    """The metrics of rollouts given as [(engine, trainer) per token] per rollout."""
    d = [e - t for row in rows for e, t in row if t != -math.inf]
    tokens = sum(len(row) for row in rows)
    ratios = [math.exp(t - e) if t != -math.inf else 0.0 for row in rows for e, t in row]
    seq_log = []  # per sequence: mean log ratio over its possible tokens; -inf if any is impossible
    for row in rows:
        if any(t == -math.inf for _, t in row):
            seq_log.append(-math.inf)
        else:
            seq_log.append(math.fsum(t - e for e, t in row) / len(row))
    finite = [s for s in seq_log if s != -math.inf]
    out = {
        "sequences": len(rows),
        "tokens": tokens,
        "tokens_impossible": tokens - len(d),
        "mean_abs_delta": _mean([abs(x) for x in d]),
        "k1": _mean(d),
        "k2": _mean([x * x / 2 for x in d]),
        "k3": _mean([math.expm1(-x) + x for x in d]),
        "ppl_ratio": _mean([math.exp(-s) for s in finite]),
        "outside_0_9_1_1": sum(1 for r in ratios if not 0.9 <= r <= 1.1) / tokens if tokens else None,
        "caps": [cap_row(c, ratios, seq_log) for c in caps],
        # every engine logprob equal to the trainer's, bit for bit (a batch-invariant engine and trainer)
        "bitwise_equal": tokens > 0 and all(e == t for row in rows for e, t in row),
    }
    return out


def cap_row(cap: float, ratios: Sequence[float], seq_log: Sequence[float]) -> dict[str, Any]:
    """What a TIS/MIS cap C would do: the shares of tokens clipped, tokens masked, sequences masked."""
    lo, hi = 1 / cap, cap
    n, m = len(ratios), len(seq_log)
    log_lo, log_hi = math.log(lo), math.log(hi)
    return {
        "cap": cap,
        "tokens_clipped": sum(1 for r in ratios if r > hi) / n if n else None,
        "tokens_masked": sum(1 for r in ratios if not lo <= r <= hi) / n if n else None,
        "sequences_masked": sum(1 for s in seq_log if not log_lo <= s <= log_hi) / m if m else None,
    }
