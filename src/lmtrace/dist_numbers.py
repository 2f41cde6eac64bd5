"""Per-step numbers of chosen tokens from distributions someone else computed (the logits and
scores `model.generate` returns, the logits a watched loop produced), with the raw and the
processed distribution each optional: what is missing stays None, never guessed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmtrace import sampling


@dataclass
class Numbers:
    """One entry per step; a list is all None where its distribution was not recorded."""

    logprob: list[float | None] = field(default_factory=list)
    sampled_logprob: list[float | None] = field(default_factory=list)
    rank: list[int | None] = field(default_factory=list)
    entropy: list[float | None] = field(default_factory=list)
    sampled_entropy: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float | None]] = field(default_factory=list)
    top_sampled_logprobs: list[list[float | None]] = field(default_factory=list)


def measure(
    raw: torch.Tensor | None,
    processed: torch.Tensor | None,
    chosen: torch.Tensor,
    top_n: int,
    processed_are_logprobs: bool = False,
) -> Numbers:
    """`raw` logits and `processed` scores are (steps, vocab), `chosen` (steps,) the tokens picked.
    The alternatives are the most likely tokens under the raw distribution, or under the processed
    one when only that is known. With `processed_are_logprobs` (beam search, whose scores are
    log-probabilities after the processors) the chosen and alternative values are read as they are,
    as transformers' compute_transition_scores reads them; otherwise they are log-softmaxed."""
    if raw is None and processed is None:
        raise ValueError("measure: a raw or a processed distribution is needed")
    steps = chosen.shape[0]
    ids = chosen[:, None]  # (steps, 1)
    none = [None] * steps
    out = Numbers()
    lp = used = None
    if raw is not None:
        lp = torch.log_softmax(raw.float(), dim=-1)  # (steps, vocab)
        own = lp.gather(-1, ids)
        out.logprob = own[:, 0].tolist()
        out.rank = ((lp > own).sum(-1) + 1).tolist()
        out.entropy = sampling.entropy(lp).tolist()
    else:
        out.logprob, out.rank, out.entropy = none, list(none), list(none)
    if processed is not None:
        p = processed.float()
        used = p if processed_are_logprobs else torch.log_softmax(p, dim=-1)
        out.sampled_logprob = used.gather(-1, ids)[:, 0].tolist()
        # entropy of the distribution the token was chosen from (normalised: a processor may not keep the sum at 1)
        out.sampled_entropy = sampling.entropy(torch.log_softmax(p, dim=-1)).tolist()
    else:
        out.sampled_logprob, out.sampled_entropy = list(none), list(none)
    if top_n:
        ranked = lp if lp is not None else used
        n = min(top_n, ranked.shape[-1])
        _, top_ids = torch.topk(ranked, n, dim=-1)  # (steps, n)
        out.top_ids = top_ids.tolist()
        out.top_logprobs = lp.gather(-1, top_ids).tolist() if lp is not None else [[None] * n] * steps
        out.top_sampled_logprobs = used.gather(-1, top_ids).tolist() if used is not None else [[None] * n] * steps
    else:
        out.top_ids, out.top_logprobs, out.top_sampled_logprobs = [[]] * steps, [[]] * steps, [[]] * steps
    return out
