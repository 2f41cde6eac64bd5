"""Speculative decoding's acceptance rule, pure math over processed logits (rows, vocab).

A draft proposed token d, drawn from q = softmax(draft's processed logits); the target's
processed distribution at the same position is p. Sampling: accept d with probability
min(1, p(d) / q(d)), else draw from norm(max(0, p - q)); the token that comes out is
distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023). Greedy: accept while d is
the target's argmax, else take the argmax. q must be the distribution d was drawn from: the
same processors as p (penalty, temperature, top-k, top-p, min-p); a raw q biases the output
(transformers #47932), which the tests show.

Every function takes rows, so one call judges one proposal in the decoding loop and twenty
thousand in the test of losslessness."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdicts:
    """The rule's outcome per row: the token emitted (the proposal, or the target's own), whether
    the proposal was accepted, the probability it had of being accepted, and its processed
    logprobs under the target (p) and the draft (q). Tensors of shape (rows,)."""

    tokens: torch.Tensor
    accepted: torch.Tensor
    accept_prob: torch.Tensor
    target_logprob: torch.Tensor
    draft_logprob: torch.Tensor


def judge(
    target: torch.Tensor, draft: torch.Tensor, proposed: torch.Tensor, greedy: bool, rng: torch.Generator | None
) -> Verdicts:
    """Judges `proposed` (rows,) drawn from softmax(`draft`) against `target`; both (rows, vocab)
    processed logits. `rng` draws the uniforms and the residual samples (sampling only)."""
    p_log = torch.log_softmax(target.float(), dim=-1)  # (rows, vocab)
    q_log = torch.log_softmax(draft.float(), dim=-1)
    ids = proposed[:, None]  # (rows, 1)
    lp, lq = p_log.gather(-1, ids)[:, 0], q_log.gather(-1, ids)[:, 0]  # (rows,)
    if greedy:
        best = target.argmax(dim=-1)
        accepted = proposed == best
        return Verdicts(best, accepted, accepted.float(), lp, lq)
    ratio = torch.exp(lp - lq).clamp(max=1.0)  # min(1, p/q); p(d) = 0 gives 0
    uniform = torch.rand(ratio.shape, generator=rng, device=ratio.device)
    accepted = uniform < ratio
    tokens = proposed.clone()
    rejected = (~accepted).nonzero()[:, 0]
    if len(rejected):
        tokens[rejected] = residual_draw(p_log[rejected].exp(), q_log[rejected].exp(), rng)
    return Verdicts(tokens, accepted, ratio, lp, lq)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row (rows, vocab); p itself where the residual has no mass (only
    reachable through rounding: a rejection needs p(d) < q(d), so p - q > 0 somewhere)."""
    mass = (p - q).clamp(min=0.0)
    total = mass.sum(dim=-1, keepdim=True)  # (rows, 1)
    return torch.where(total > 0, mass / total.clamp(min=torch.finfo(mass.dtype).tiny), p)


def residual_draw(p: torch.Tensor, q: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
    """One token per row (rows,) from the residual distribution of probabilities p and q."""
    return torch.multinomial(residual(p, q), num_samples=1, generator=rng)[:, 0]
