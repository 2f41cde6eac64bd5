"""How sure was the model about the whole answer: the per-sequence estimators over the generated
tokens' per-token numbers, with LM-Polygraph's definitions (its estimator in brackets) and
DeepConf's (arXiv 2508.15260). Higher means more uncertain for LM-Polygraph's scores; DeepConf's
confidences are the other way round (higher: more confident).

    msp           -sum log p                                   (MaximumSequenceProbability)
    mean_nll      -mean log p                                  (Perplexity)
    perplexity    exp(mean_nll)
    mean_entropy  mean entropy of the step distributions       (MeanTokenEntropy)
    max_entropy   the largest of them
    renyi_neg     -mean Rényi divergence to uniform            (RenyiNeg)
    fisher_rao    -mean Fisher-Rao distance to uniform          (FisherRao)
    pmi           -mean (log p(y|x) - log p(y)), the first token's own term unconditioned
                                                               (MeanPointwiseMutualInformation)
    cpmi          -mean (log p(y|x) - lambda log p(y) where the entropy >= tau)
                                                               (MeanConditionalPointwiseMutualInformation)
    deepconf      {mean, bottom10, lowest_group, tail, groups}: group i = mean confidence over
                  the window ending at token i (window = min(W, T), i >= window - 1)

Pure Python over lists of floats: no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lmtrace.errors import InvalidParameter

# LM-Polygraph's defaults for conditional PMI (best according to arXiv 2210.13210)
CPMI_TAU = 0.0656
CPMI_LAMBDA = 3.599


def check(k: int, window: int, tail: int, vocab: int | None = None) -> None:
    """The settings of the confidence scores, each >= 1 and k at most the vocabulary."""
    for name, value in (("confidence_k", k), ("confidence_window", window), ("confidence_tail", tail)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameter(f"{name} must be an integer >= 1, got {value!r}")
    if vocab is not None and k > vocab:
        raise InvalidParameter(f"confidence_k must be at most the vocabulary size ({vocab}), got {k}")


def groups(confidences: Sequence[float], window: int) -> list[float]:
    """DeepConf's group confidences: the mean over each window of min(window, T) tokens."""
    w = min(window, len(confidences))
    if w == 0:
        return []
    prefix = [0.0]
    for c in confidences:  # float64 prefix sums: 1e-12 off an fsum over a 2048-token window
        prefix.append(prefix[-1] + c)
    return [(prefix[i + 1] - prefix[i + 1 - w]) / w for i in range(w - 1, len(confidences))]


def deepconf(confidences: Sequence[float], window: int, tail: int) -> dict[str, Any]:
    """{mean, bottom10, lowest_group, tail, groups} of one trace's token confidences."""
    if not confidences:
        return {"mean": None, "bottom10": None, "lowest_group": None, "tail": None, "groups": []}
    g = groups(confidences, window)
    lowest = sorted(g)[: math.ceil(0.1 * len(g))]
    last = confidences[-min(tail, len(confidences)) :]
    return {
        "mean": _mean(confidences),
        "bottom10": _mean(lowest),
        "lowest_group": min(g),
        "tail": _mean(last),
        "groups": g,
    }


def likelihood(logprobs: Sequence[float], entropies: Sequence[float]) -> dict[str, Any]:
    """{msp, mean_nll, perplexity, mean_entropy, max_entropy} of one trace's logprobs and entropies."""
    if not logprobs:
        return {"msp": None, "mean_nll": None, "perplexity": None, "mean_entropy": None, "max_entropy": None}
    mean_nll = -_mean(logprobs)
    return {
        "msp": -math.fsum(logprobs),
        "mean_nll": mean_nll,
        "perplexity": _exp(mean_nll),
        "mean_entropy": _mean(entropies),
        "max_entropy": max(entropies),
    }


def lowest_token(logprobs: Sequence[float], token_ids: Sequence[int], texts: Sequence[str]) -> dict[str, Any] | None:
    """The least likely generated token and where it is: {index, token_id, text, logprob}."""
    if not logprobs:
        return None
    i = min(range(len(logprobs)), key=lambda j: logprobs[j])
    return {"index": i, "token_id": token_ids[i], "text": texts[i], "logprob": logprobs[i]}


def pmi_terms(logprobs: Sequence[float], unconditioned: Sequence[float]) -> list[float]:
    """PMI's token terms log p(y_t | x, y<t) - log p(y_t | y<t); the first token keeps its
    conditioned logprob alone (LM-Polygraph's rule: no unconditioned prediction for it)."""
    return [lp - (u if t > 0 else 0.0) for t, (lp, u) in enumerate(zip(logprobs, unconditioned))]


def cpmi_terms(
    logprobs: Sequence[float],
    unconditioned: Sequence[float],
    entropies: Sequence[float],
    tau: float = CPMI_TAU,
    lambd: float = CPMI_LAMBDA,
) -> list[float]:
    """Conditional PMI's token terms: log p(y|x) - lambda log p(y) where t > 0 and the step's
    entropy is at least tau, else log p(y|x)."""
    out = []
    for t, (lp, u, h) in enumerate(zip(logprobs, unconditioned, entropies)):
        out.append(lp - lambd * u if t > 0 and h >= tau else lp)
    return out


def negated_mean(terms: Sequence[float]) -> float | None:
    """-mean of token terms (LM-Polygraph's sign: higher, more uncertain); None without terms."""
    return None if not terms else -_mean(terms)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
