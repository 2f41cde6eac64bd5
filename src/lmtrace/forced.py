"""Teacher forcing: the numbers of known target tokens from logits computed over a known
sequence (the logits at position t predict the token at t + 1), and their records.

Used by scoring, by `generate(echo=True)` for the prompt (from the prefill pass) and by rescore."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmtrace import sampling
from lmtrace.detokenize import REPLACEMENT, TokenBytes
from lmtrace.records import Candidate, TokenScore

# rows per log-softmax: the (rows, vocab) float32 temporaries of a chunk stay in the CPU's
# last-level cache (32 x 49152 x 4 B = 6 MB); 512-row chunks measured up to 2x slower here
CHUNK = 32


@dataclass
class Forced:
    """Per-target numbers under the raw distribution (float32 log-softmax, temperature 1)."""

    logprob: list[float] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: Forced) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))


def measure_targets(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> Forced:
    """`logits` (n, vocab) predict `targets` (n,): logprob, 1-based rank, entropy, top alternatives."""
    out = Forced()
    for start in range(0, logits.shape[0], CHUNK):
        raw = torch.log_softmax(logits[start : start + CHUNK].float(), dim=-1)  # (rows, vocab)
        chosen = targets[start : start + CHUNK, None].to(raw.device)  # (rows, 1)
        lp = raw.gather(-1, chosen)
        rank = (raw > lp).sum(-1, keepdim=True) + 1  # same rule as the decoding loop
        out.logprob += lp[:, 0].tolist()
        out.rank += rank[:, 0].tolist()
        out.entropy += sampling.entropy(raw).tolist()
        if top_n:
            top_lp, top_ids = torch.topk(raw, top_n, dim=-1)  # (rows, top_n)
            out.top_ids += top_ids.tolist()
            out.top_logprobs += top_lp.tolist()
        else:
            out.top_ids += [[] for _ in range(raw.shape[0])]
            out.top_logprobs += [[] for _ in range(raw.shape[0])]
    return out


def text_pieces(tokenizer, ids: Sequence[int], start: int = 0) -> list[str]:
    """The text each of ids[start:] adds, decoding only a few tokens at a time (linear in the
    length, unlike re-decoding the whole prefix). For byte-level tokenizers the pieces join to
    decode(ids)[len(decode(ids[:start])):]; a character split over tokens lands on the token
    that completes it."""
    ids = list(ids)
    prefix, read = max(0, start - 5), start  # a little left context, as TGI and vLLM do
    pieces = []
    for i in range(start, len(ids)):
        before = tokenizer.decode(ids[prefix:read])
        now = tokenizer.decode(ids[prefix : i + 1])
        if len(now) > len(before) and not now.endswith(REPLACEMENT) and now.startswith(before):
            pieces.append(now[len(before) :])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    if read < len(ids):  # an incomplete character at the very end: emit what decode() gives
        before = tokenizer.decode(ids[prefix:read])
        pieces[-1] += tokenizer.decode(ids[prefix:])[len(before) :]
    return pieces


def token_scores(
    tokenizer, ids: Sequence[int], first: int, numbers: Forced, tb: TokenBytes | None = None
) -> list[TokenScore]:
    """Records for ids[first:]; `numbers` holds one entry per id from max(first, 1) on (the
    token at position 0 has no context, so its numbers are null)."""
    tb = tb or TokenBytes(tokenizer)
    pieces = text_pieces(tokenizer, ids, first)
    records = []
    offset = max(first, 1)
    for i, piece in zip(range(first, len(ids)), pieces):
        token = ids[i]
        if i == 0:
            records.append(TokenScore(token, piece, list(tb(token)), None, None, None, []))
            continue
        j = i - offset
        top = [Candidate(t, tb.text(t), list(tb(t)), lp) for t, lp in zip(numbers.top_ids[j], numbers.top_logprobs[j])]
        records.append(
            TokenScore(token, piece, list(tb(token)), numbers.logprob[j], numbers.rank[j], numbers.entropy[j], top)
        )
    return records
