"""The one rule for the numbers of a chosen token, used by every caller: the logprob under the
raw distribution (float32 log-softmax, temperature 1, nothing filtered), the 1-based rank
(1 + the number of tokens strictly more likely), the entropy in nats, the raw top-n.

Three shapes of the same rule: `chosen` for a decoding step (raw and processed side by side,
moved to the host in two transfers), `targets` for teacher forcing (known tokens, chunked), and
`recorded` for distributions someone else computed, where either side may be missing."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# rows per log-softmax in teacher forcing: the (rows, vocab) float32 temporaries of a chunk stay
# in the CPU's last-level cache (32 x 49152 x 4 B = 6 MB); 512-row chunks measured up to 2x slower
CHUNK = 32


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last axis; filtered tokens (-inf) contribute 0."""
    # -inf clamped to the most negative finite float: 0 * finite is 0, where 0 * -inf is NaN;
    # one clamp is cheaper than a where over the vocabulary
    finite = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    terms = logprobs.exp() * finite
    if terms.dim() and terms.numel() == terms.shape[-1] > 1:
        # a lone row summed as a pair: torch splits one long row's sum over its threads (another
        # order), and a row among others it sums whole; so a row gets the same bits in any batch
        pair = terms.reshape(1, -1).expand(2, -1).contiguous()  # (1, vocab) -> (2, vocab)
        return -pair.sum(dim=-1)[0].reshape(terms.shape[:-1])
    return -terms.sum(dim=-1)


def rank(logprobs: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """1-based rank of `own` (..., 1) among `logprobs` (..., vocab): ties share the better rank."""
    return (logprobs > own).sum(-1, dtype=torch.int32) + 1  # an int32 count: half the time of int64's


def top(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest of `logprobs` (..., vocab) and their ids, largest first (n 1: max, three
    times faster than topk on a CPU)."""
    if n == 1:
        return logprobs.max(dim=-1, keepdim=True)
    return torch.topk(logprobs, n, dim=-1)


def chosen(logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[list, list]:
    """A decoding step's numbers per row: floats [logprob, sampled_logprob, entropy,
    sampled_entropy, top logprobs..., top sampled logprobs...] and ints [token, rank, top ids...]
    for `tokens` (batch,) under the raw `logits` and the `processed` ones (batch, vocab)."""
    floats, ints = chosen_tensors(logits, processed, tokens, top_n)
    return floats.tolist(), ints.tolist()


def chosen_tensors(
    logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chosen`'s rows as tensors still on the device, (batch, 4 + 2 top_n) float32 and (batch,
    2 + top_n) int64: no host synchronisation (the compiled step, lmtrace.decode.static)."""
    raw = torch.log_softmax(logits, dim=-1)  # (batch, vocab)
    same = processed is logits  # greedy without penalty: one distribution, computed once
    used = raw if same else torch.log_softmax(processed, dim=-1)
    ids = tokens[:, None]  # (batch, 1)
    lp = raw.gather(-1, ids)
    raw_entropy = entropy(raw)[:, None]
    used_entropy = raw_entropy if same else entropy(used)[:, None]
    floats = [lp, lp if same else used.gather(-1, ids), raw_entropy, used_entropy]
    ints = [ids, rank(raw, lp)[:, None].long()]
    if top_n:
        top_lp, top_ids = top(raw, top_n)  # (batch, top_n)
        floats += [top_lp, used.gather(-1, top_ids)]
        ints.append(top_ids)
    return torch.cat(floats, -1), torch.cat(ints, -1)


@dataclass
class Forced:
    """Per-target numbers of teacher forcing under the raw distribution."""

    logprob: list[float] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: Forced) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))


def targets(logits: torch.Tensor, target_ids: torch.Tensor, top_n: int) -> Forced:
    """Teacher forcing: `logits` (n, vocab) predict `target_ids` (n,): logprob, rank, entropy,
    the raw top-n. Score, echo (the prefill's prompt rows) and the server's echo all use this."""
    out = Forced()
    for start in range(0, logits.shape[0], CHUNK):
        raw = torch.log_softmax(logits[start : start + CHUNK].float(), dim=-1)  # (rows, vocab)
        ids = target_ids[start : start + CHUNK, None].to(raw.device)  # (rows, 1)
        lp = raw.gather(-1, ids)
        out.logprob += lp[:, 0].tolist()
        out.rank += rank(raw, lp).tolist()
        out.entropy += entropy(raw).tolist()
        if top_n:
            top_lp, top_ids = top(raw, top_n)  # (rows, top_n)
            out.top_ids += top_ids.tolist()
            out.top_logprobs += top_lp.tolist()
        else:
            out.top_ids += [[] for _ in range(raw.shape[0])]
            out.top_logprobs += [[] for _ in range(raw.shape[0])]
    return out


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


def recorded(
    raw: torch.Tensor | None,
    processed: torch.Tensor | None,
    tokens: torch.Tensor,
    top_n: int,
    processed_are_logprobs: bool = False,
) -> Numbers:
    """Numbers from distributions someone else computed (model.generate's logits and scores, a
    watched loop's logits): `raw` logits and `processed` scores are (steps, vocab), `tokens`
    (steps,) the tokens picked; what is missing stays None, never guessed. The alternatives are
    the most likely tokens under the raw distribution, or under the processed one when only that
    is known. With `processed_are_logprobs` (beam search, whose scores are log-probabilities
    after the processors) the values are read as they are, as transformers'
    compute_transition_scores reads them; otherwise they are log-softmaxed."""
    if raw is None and processed is None:
        raise ValueError("measure: a raw or a processed distribution is needed")
    steps = tokens.shape[0]
    ids = tokens[:, None]  # (steps, 1)
    none = [None] * steps
    out = Numbers()
    lp = used = None
    if raw is not None:
        lp = torch.log_softmax(raw.float(), dim=-1)  # (steps, vocab)
        own = lp.gather(-1, ids)
        out.logprob, out.rank, out.entropy = own[:, 0].tolist(), rank(lp, own).tolist(), entropy(lp).tolist()
    else:
        out.logprob, out.rank, out.entropy = none, list(none), list(none)
    if processed is not None:
        p = processed.float()
        used = p if processed_are_logprobs else torch.log_softmax(p, dim=-1)
        out.sampled_logprob = used.gather(-1, ids)[:, 0].tolist()
        # entropy of the distribution the token was chosen from (normalised: a processor may not keep the sum at 1)
        out.sampled_entropy = entropy(torch.log_softmax(p, dim=-1)).tolist()
    else:
        out.sampled_logprob, out.sampled_entropy = list(none), list(none)
    _alternatives(out, lp, used, top_n, steps)
    return out


def _alternatives(out: Numbers, lp: torch.Tensor | None, used: torch.Tensor | None, top_n: int, steps: int) -> None:
    if not top_n:
        out.top_ids, out.top_logprobs, out.top_sampled_logprobs = [[]] * steps, [[]] * steps, [[]] * steps
        return
    ranked = lp if lp is not None else used
    n = min(top_n, ranked.shape[-1])
    _, top_ids = torch.topk(ranked, n, dim=-1)  # (steps, n)
    out.top_ids = top_ids.tolist()
    out.top_logprobs = lp.gather(-1, top_ids).tolist() if lp is not None else [[None] * n] * steps
    out.top_sampled_logprobs = used.gather(-1, top_ids).tolist() if used is not None else [[None] * n] * steps
