"""Teacher forcing's records: the text piece of each known token and its TokenScore, from the
numbers lmtrace.logits.measure.targets computed (the logits at position t predict token t + 1).

Used by scoring, by `generate(echo=True)` for the prompt (from the prefill pass) and by rescore."""

from __future__ import annotations

from collections.abc import Sequence

from lmtrace.detokenize import REPLACEMENT, TokenBytes
from lmtrace.logits.measure import Forced
from lmtrace.records import Candidate, TokenScore


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
