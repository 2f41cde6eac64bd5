"""The `uncertainty` observer: at every step the token's confidence, margin and varentropy (and
the two distances to uniform) under the raw distribution, and under the processed one where the
row samples (`sampled_` prefix); on the trace the per-sequence scores (lmtrace.logits.sequence).

    trace = lmtrace.generate(lm, prompt, uncertainty=True)          # k 20, window and tail 2048
    trace = lmtrace.generate(lm, prompt, observers=[Uncertainty(k=5, window=16)])
    trace.steps[3].uncertainty["confidence"]; trace.uncertainty["deepconf"]["lowest_group"]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmtrace.decode.observers import Observer
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.logits import sequence
from lmtrace.logits import uncertainty as scores
from lmtrace.records import Step

__all__ = ["Uncertainty", "observer_for"]

# the per-token scores also taken under the processed distribution of a sampled step
SAMPLED = ("confidence", "margin", "varentropy")


class Uncertainty(Observer):
    """Per-token and per-sequence uncertainty. `k`: the number of top logprobs in DeepConf's
    token confidence (the chosen token included); `window`: DeepConf's group size; `tail`: the
    number of final tokens in the tail confidence (both capped at the trace's length)."""

    name = "uncertainty"

    def __init__(self, k: int = 20, window: int = 2048, tail: int = 2048, vocab: int | None = None):
        sequence.check(k, window, tail, vocab)
        self.k, self.window, self.tail = k, window, tail

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> list[Any]:
        """One entry per row: {confidence, margin, varentropy, renyi, fisher_rao} under the raw
        distribution, and sampled_confidence, sampled_margin, sampled_varentropy where it samples."""
        raw = torch.log_softmax(logits.float(), dim=-1)  # (batch, vocab)
        measured = scores.scores(raw, tokens, self.k)
        sampled = [not (how.params[0] if how.shared else how.params[r]).greedy for r in range(len(tokens))]
        used: dict[str, list] = {}
        if any(sampled):
            processed = torch.log_softmax(how.process(logits, step.allowed).float(), dim=-1)  # (batch, vocab)
            used = {
                "confidence": scores.confidence(processed, tokens, self.k).tolist(),
                "margin": scores.margin(processed).tolist(),
                "varentropy": scores.varentropy(processed).tolist(),
            }
        out: list[Any] = []
        for r in range(len(tokens)):
            if not step.active[r]:
                out.append(None)
                continue
            entry = {name: _finite(values[r]) for name, values in measured.items()}
            if sampled[r]:
                entry.update({f"sampled_{name}": _finite(used[name][r]) for name in SAMPLED})
            out.append(entry)
        return out

    def summarize(self, steps: list[Step]) -> dict[str, Any] | None:
        """The trace's scores over its generated tokens (None: no steps or no raw numbers)."""
        entries = [s.entries.get(self.name) for s in steps]
        if not steps or any(e is None for e in entries) or any(s.logprob is None for s in steps):
            return None
        out = summary([s.logprob for s in steps], [s.entropy for s in steps], [e["confidence"] for e in entries],
                      self.window, self.tail)  # fmt: skip
        out["renyi_neg"] = sequence.negated_mean([e["renyi"] for e in entries])
        out["fisher_rao"] = sequence.negated_mean([e["fisher_rao"] for e in entries])
        out["lowest_token"] = sequence.lowest_token([s.logprob for s in steps], [s.token_id for s in steps],
                                                    [s.text for s in steps])  # fmt: skip
        if all("sampled_confidence" in e for e in entries):  # a sampled trace: the processed side too
            used = summary([s.sampled_logprob for s in steps], [s.sampled_entropy for s in steps],
                           [e["sampled_confidence"] for e in entries], self.window, self.tail)  # fmt: skip
            out.update({f"sampled_{name}": value for name, value in used.items()})
        out["settings"] = {"k": self.k, "window": self.window, "tail": self.tail}
        return out


def summary(logprobs: list[float], entropies: list[float], confidences: list[float], window: int,
            tail: int) -> dict[str, Any]:  # fmt: skip
    """{msp, mean_nll, perplexity, mean_entropy, max_entropy, deepconf} of one side."""
    out = sequence.likelihood(logprobs, entropies)
    out["deepconf"] = sequence.deepconf(confidences, window, tail)
    return {k: _finite(v) if isinstance(v, float) else v for k, v in out.items()}


def observer_for(uncertainty: bool | Uncertainty, vocab: int) -> list[Observer]:
    """The observer `uncertainty=` asks for: none (False), the defaults (True) or the one given."""
    if isinstance(uncertainty, Uncertainty):
        sequence.check(uncertainty.k, uncertainty.window, uncertainty.tail, vocab)
        return [uncertainty]
    return [Uncertainty(vocab=vocab)] if uncertainty else []


def _finite(x: float) -> float | None:
    """JSON has no infinity: a score that is infinite (one token left) is written null."""
    return x if math.isfinite(x) else None
