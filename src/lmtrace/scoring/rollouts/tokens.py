"""The exact per-token numbers of a rollout from its teacher-forced logits: the raw logprob
(float32 log-softmax, temperature 1, no filter) and the processed one (the rollout's own
sampling settings through the decoding processors, lmtrace.logits.sampling.process_logits,
renormalised), and the other processings the engine may have reported instead."""

from __future__ import annotations

from dataclasses import replace

import torch

from lmtrace.logits.sampling import process_logits
from lmtrace.params import SamplingParams

# the processing steps a rollout's settings can switch on, in the processors' order
STEPS = ("temperature", "top_k", "top_p", "min_p")
OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def chosen(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[j, ids[j]] for each row j: (n, vocab), (n,) -> (n,) float32."""
    # log_softmax itself (not logit - logsumexp): the engine's very rounding, so that rollouts of a
    # batch-invariant engine teacher-force to the same bits
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, None])[:, 0]


def raw_and_processed(
    logits: torch.Tensor, ids: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, processed) logprobs of `ids` (n,) under logits (n, vocab); a token the processors
    remove has processed logprob -inf."""
    raw = chosen(logits, ids)
    if active(params) == [] or params.greedy:
        return raw, raw.clone()
    return raw, chosen(process_logits(logits.float(), params, None), ids)


def active(params: SamplingParams) -> list[str]:
    """The steps the settings switch on (greedy: none)."""
    if params.greedy:
        return []
    return [s for s in STEPS if getattr(params, s) != OFF[s]]


def without(params: SamplingParams, steps: tuple[str, ...]) -> SamplingParams:
    """The settings with `steps` switched off."""
    return replace(params, **{s: OFF[s] for s in steps})


def alternatives(logits: torch.Tensor, ids: torch.Tensor, params: SamplingParams) -> dict[str, torch.Tensor]:
    """What an engine that got the processing wrong would report, name -> (n,) logprobs:
    `raw` (no processing at all) and, with two or more steps on, `without_<step>` (that one
    step missing, e.g. top-p applied to sample but not renormalised in the reported logprob)."""
    on = active(params)
    out = {"raw": chosen(logits, ids)}
    if len(on) > 1:
        for step in on:
            out[f"without_{step}"] = chosen(process_logits(logits.float(), without(params, (step,)), None), ids)
    return out


def temperature_fit(logits: torch.Tensor, ids: torch.Tensor, engine: torch.Tensor) -> tuple[float, float]:
    """(T, mean |engine - log_softmax(logits / T)[ids]|) for the temperature in [0.05, 4] that
    fits the engine's logprobs best (a golden-section search on log T): an engine that applied
    a temperature the settings do not say."""
    logits = logits.float()

    def gap(log_t: float) -> float:
        return float((engine - chosen(logits / float(torch.exp(torch.tensor(log_t))), ids)).abs().mean())

    a, b = float(torch.log(torch.tensor(0.05))), float(torch.log(torch.tensor(4.0)))
    g = (5**0.5 - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = gap(c), gap(d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = gap(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = gap(d)
    best = (a + b) / 2
    return float(torch.exp(torch.tensor(best))), gap(best)
