"""The text of a vLLM completion as lmtrace writes it: per-token pieces from lmtrace's own
detokenizer (byte-exact, a character split over tokens lands on the token completing it), the
end token's text left out, the text cut before a stop string, as lmtrace's loop does."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lmtrace.detokenize import pieces
from lmtrace.stops import StopStrings, finish_reason


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
    held = StopStrings(stops if ended and before_eos is None else ())
    held.feed("".join(texts))
    text = before_eos if before_eos is not None else held.text[: held.cut]
    reason = token_ids[-1] if before_eos is not None else held.stop
    finish = finish_reason(before_eos is not None, held.cut is not None, not ended, openai=True)
    return Text(texts, text, finish, reason)
