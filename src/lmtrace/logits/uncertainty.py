"""How sure was the model at one step: the per-token uncertainty scores of a distribution, pure
math over logits (no model, no cache).

    confidence   DeepConf's token confidence: -mean of the k highest logprobs, the chosen token
                 included (k + 1 values where it is not among the k, as an API's top-k plus the
                 sampled token gives them)
    margin       top-1 minus top-2 logprob
    varentropy   the variance of -log p under p: sum p (log p)^2 - (sum p log p)^2
    renyi        Rényi divergence of order alpha from the uniform distribution, of the
                 distribution at temperature 2 (LM-Polygraph's RenyiNeg token term)
    fisher_rao   the Fisher-Rao distance to uniform, 2/pi arccos(sum sqrt(p_i / V)), at
                 temperature 2 (LM-Polygraph's FisherRao token term)

Sums run in float64 over the float32 log-softmax: varentropy is a difference of two sums of
~|V| terms, where float32 would lose the digits that matter."""

from __future__ import annotations

import math

import torch

# LM-Polygraph's defaults for the two distances to uniform (estimators/renyi_neg.py, fisher_rao.py)
RENYI_ALPHA = 0.5
POLYGRAPH_TEMPERATURE = 2.0


def confidence(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """DeepConf's confidence (batch,) of `logprobs` (batch, vocab) with the chosen `tokens`
    (batch,): -mean of the k highest finite logprobs together with the chosen token's, where the
    chosen one is not among them. Filtered tokens (-inf) never count: fewer than k may be left."""
    lp = logprobs.double()
    top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1).values  # (batch, k)
    finite = torch.isfinite(top)
    own = lp.gather(-1, tokens[:, None])  # (batch, 1)
    # the chosen token is outside the top-k where it is strictly below the k-th value
    outside = (own[:, 0] < top[:, -1]) & torch.isfinite(own[:, 0])
    total = torch.where(finite, top, 0.0).sum(-1) + torch.where(outside, own[:, 0], 0.0)
    count = finite.sum(-1) + outside.long()
    return -total / count


def margin(logprobs: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logprob (batch,); inf where only one token is left."""
    if logprobs.shape[-1] < 2:
        return torch.full(logprobs.shape[:-1], math.inf, dtype=torch.float64)
    top2 = torch.topk(logprobs.double(), 2, dim=-1).values  # (batch, 2)
    return top2[:, 0] - top2[:, 1]


def varentropy(logprobs: torch.Tensor) -> torch.Tensor:
    """The variance of -log p under p (batch,), in nats squared, as DESIGN.md writes it:
    sum p (log p)^2 - (sum p log p)^2; filtered tokens contribute 0. (The centred form
    sum p (log p + H)^2 differs by H^2 (sum p - 1): float32 probabilities sum to 1 only within
    ~1e-7.)"""
    lp = logprobs.double()
    p = lp.exp()
    finite = torch.where(torch.isfinite(lp), lp, 0.0)
    return (p * finite**2).sum(-1) - (p * finite).sum(-1) ** 2


def renyi(
    logprobs: torch.Tensor, alpha: float = RENYI_ALPHA, temperature: float = POLYGRAPH_TEMPERATURE
) -> torch.Tensor:
    """Rényi divergence D_alpha(p_T || uniform) (batch,) of the distribution at `temperature`:
    1/(alpha-1) log sum p^alpha + log V (alpha 1: the KL divergence, log V - H)."""
    lp = torch.log_softmax(logprobs.double() / temperature, dim=-1)
    vocab = math.log(lp.shape[-1])
    if alpha == 1:
        finite = torch.where(torch.isfinite(lp), lp, 0.0)
        return (lp.exp() * finite).sum(-1) + vocab
    return torch.logsumexp(alpha * lp, dim=-1) / (alpha - 1) + vocab


def fisher_rao(logprobs: torch.Tensor, temperature: float = POLYGRAPH_TEMPERATURE) -> torch.Tensor:
    """The Fisher-Rao distance to uniform (batch,), 2/pi arccos(sum sqrt(p_i) sqrt(1/V)), of the
    distribution at `temperature`."""
    lp = torch.log_softmax(logprobs.double() / temperature, dim=-1)
    inner = (lp / 2).exp().sum(-1) * math.sqrt(1.0 / lp.shape[-1])
    return 2 / math.pi * torch.arccos(inner.clamp(max=1.0))


def scores(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> dict[str, list[float]]:
    """Every per-token score of one distribution per row: {name: (batch,) as a list}."""
    return {
        "confidence": confidence(logprobs, tokens, k).tolist(),
        "margin": margin(logprobs).tolist(),
        "varentropy": varentropy(logprobs).tolist(),
        "renyi": renyi(logprobs).tolist(),
        "fisher_rao": fisher_rao(logprobs).tolist(),
    }
