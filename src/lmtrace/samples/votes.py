"""Votes and answer-level uncertainty over many samples of one prompt; pure Python (no torch).
Clusters are answers equal after normalisation (samples/answers.py); a sample without an answer
votes for nothing and sits in no cluster.

    majority                  the most frequent answer (ties: the one seen first)
    weighted                  DeepConf's confidence-weighted vote: the answers of the traces in
                              the top eta percent by confidence, each weighing its confidence
    semantic_entropy          LM-Polygraph's SemanticEntropy with equality for entailment:
                              -mean over samples of log sum_{i in its cluster} p(sample i)
    discrete_semantic_entropy -sum f log f over the clusters' frequencies (Farquhar et al. 2024)
    mc_sequence_entropy       -mean log p(sample)         (MonteCarloSequenceEntropy)
    mc_normalized_entropy     -mean (mean token log p)    (MonteCarloNormalizedSequenceEntropy)
    num_sets                  the number of clusters      (NumSemSets)
    choice_entropy            -sum p log p over a --choice constraint's exact marginals"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def majority(answers: Sequence[str | None]) -> dict[str, Any]:
    """{answer, count, share, counts}: share over the samples that have an answer."""
    counts: dict[str, int] = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return {"answer": None, "count": 0, "share": None, "counts": {}}
    best = max(counts, key=lambda a: counts[a])  # max keeps the first of equals: the first seen
    return {"answer": best, "count": counts[best], "share": counts[best] / sum(counts.values()), "counts": counts}


def top_eta(confidences: Sequence[float | None], eta: float) -> list[int]:
    """The indices of the traces in the top `eta` percent by confidence (at least one; DeepConf's
    filter: eta 10 for DeepConf-low, 90 for DeepConf-high, 100 keeps all)."""
    have = [i for i, c in enumerate(confidences) if c is not None]
    keep = max(1, math.ceil(len(have) * eta / 100)) if have else 0
    return sorted(sorted(have, key=lambda i: -confidences[i])[:keep])  # type: ignore[operator]


def weighted(answers: Sequence[str | None], confidences: Sequence[float | None], eta: float = 100.0) -> dict[str, Any]:
    """DeepConf's vote: {answer, weights: {answer: sum of confidences}, share, kept: indices}."""
    kept = top_eta(confidences, eta)
    weights: dict[str, float] = {}
    for i in kept:
        if answers[i] is not None:
            weights[answers[i]] = weights.get(answers[i], 0.0) + confidences[i]  # type: ignore[index, operator]
    if not weights:
        return {"answer": None, "weights": {}, "share": None, "kept": kept, "eta": eta}
    best = max(weights, key=lambda a: weights[a])
    total = math.fsum(weights.values())
    return {
        "answer": best,
        "weights": weights,
        "share": weights[best] / total if total else None,
        "kept": kept,
        "eta": eta,
    }


def semantic_entropy(answers: Sequence[str | None], log_probs: Sequence[float]) -> float | None:
    """LM-Polygraph's SemanticEntropy over the samples with an answer: each cluster's log
    probability log sum exp(log p(sample)), then -mean over the samples of their cluster's."""
    members: dict[str, list[float]] = {}
    for a, lp in zip(answers, log_probs):
        if a is not None:
            members.setdefault(a, []).append(lp)
    if not members:
        return None
    cluster = {a: _logsumexp(lps) for a, lps in members.items()}
    values = [cluster[a] for a in answers if a is not None]
    return -math.fsum(values) / len(values)


def discrete_semantic_entropy(answers: Sequence[str | None]) -> float | None:
    """-sum f log f over the clusters' shares of the answered samples."""
    counts = majority(answers)["counts"]
    total = sum(counts.values())
    if not total:
        return None
    return 0.0 - math.fsum(c / total * math.log(c / total) for c in counts.values())  # never -0.0


def mc_sequence_entropy(log_probs: Sequence[float]) -> float | None:
    return None if not log_probs else -math.fsum(log_probs) / len(log_probs)


def mc_normalized_entropy(token_logprobs: Sequence[Sequence[float]]) -> float | None:
    means = [math.fsum(lps) / len(lps) for lps in token_logprobs if lps]
    return None if not means else -math.fsum(means) / len(means)


def num_sets(answers: Sequence[str | None]) -> int:
    return len({a for a in answers if a is not None})


def choice_entropy(choices: Sequence[dict[str, Any]]) -> float:
    """-sum p log p over the options' exact probabilities under the constraint (no sampling)."""
    return -math.fsum(
        math.exp(c["logprob"]) * c["logprob"]
        for c in choices
        if c["logprob"] is not None and math.isfinite(c["logprob"])
    )


def consensus(vote: dict[str, Any]) -> float | None:
    """The share of the leading answer in a weighted vote (DeepConf stops sampling at >= tau)."""
    return vote.get("share")


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(math.fsum(math.exp(v - top) for v in values))
