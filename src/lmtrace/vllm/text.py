"""The text of a vLLM completion as lmtrace writes it: per-token pieces from lmtrace's own
detokenizer (byte-exact, a character split over tokens lands on the token completing it), the
end token's text left out, the text cut before a stop string, as lmtrace's loop does."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lmtrace.detokenize import pieces


@dataclass
class Text:
    pieces: list[str]
    text: str
    finish_reason: str  # "stop" (an end token or a stop string) or "length"
    stop_reason: str | int | None


def completion_text(
    tokenizer: Any, token_ids: Sequence[int], stops: Iterable[str], eos_ids: Iterable[int], ended: bool
) -> Text:
    """`ended`: vLLM finished the request on an end token or a stop string (finish_reason "stop")."""
    eos = set(eos_ids)
    texts = pieces(tokenizer, token_ids)
    before_eos = None
    if token_ids and ended and token_ids[-1] in eos:  # the answer ends before the end token, held bytes included
        before_eos = tokenizer.decode(list(token_ids[:-1]))
    full = "".join(texts)
    if before_eos is not None:
        return Text(texts, before_eos, "stop", token_ids[-1])
    hits = [(full.find(s), s) for s in stops if full.find(s) >= 0] if ended else []
    if hits:
        cut, stop = min(hits)
        return Text(texts, full[:cut], "stop", stop)
    return Text(texts, full, "length" if not ended else "stop", None)
