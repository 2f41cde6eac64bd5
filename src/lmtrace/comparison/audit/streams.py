"""Streamed answers put back together: the events of one choice joined into the shape of a
non-streamed answer, and each chunk's text beside the tokens it carried, to see whether the
streamed logprobs line up with the streamed text."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from lmtrace.comparison.audit.reference import Reference
from lmtrace.comparison.parse import Token, token_bytes


@dataclass
class Streamed:
    choice: dict[str, Any]  # in the non-streamed shape
    chunks: list[tuple[str, int]] = field(default_factory=list)  # (text sent, tokens carried) per chunk
    usage: dict[str, Any] | None = None


def completion_stream(events: list[dict[str, Any]]) -> Streamed:
    """Choice 0 of a streamed /v1/completions answer."""
    text, finish = "", None
    lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    out = Streamed({})
    for event in events:
        out.usage = event.get("usage") or out.usage
        for c in event.get("choices") or []:
            if c.get("index", 0) != 0:
                continue
            piece, got = c.get("text") or "", c.get("logprobs") or {}
            tokens = got.get("tokens") or []
            lp["tokens"] += tokens
            lp["token_logprobs"] += got.get("token_logprobs") or [None] * len(tokens)
            lp["top_logprobs"] += got.get("top_logprobs") or [None] * len(tokens)
            text += piece
            out.chunks.append((piece, len(tokens)))
            finish = c.get("finish_reason") or finish
    out.choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
    return out


def chat_stream(events: list[dict[str, Any]]) -> Streamed:
    """Choice 0 of a streamed /v1/chat/completions answer."""
    text, finish, content = "", None, []
    out = Streamed({})
    for event in events:
        out.usage = event.get("usage") or out.usage
        for c in event.get("choices") or []:
            if c.get("index", 0) != 0:
                continue
            piece = (c.get("delta") or {}).get("content") or ""
            items = (c.get("logprobs") or {}).get("content") or []
            content += items
            text += piece
            out.chunks.append((piece, len(items)))
            finish = c.get("finish_reason") or finish
    out.choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": {"content": content},
        "finish_reason": finish,
    }
    return out


def misaligned(ref: Reference, chunks: list[tuple[str, int]], tokens: list[Token]) -> str | None:
    """Where a chunk sends text before the tokens that spell it arrive (held-back text is fine:
    a server may wait for a whole character), or where the two disagree at the end; None if never.
    Special tokens' text counts or not, as the server's text shows (see base.spellings)."""
    found = [_misaligned(ref, chunks, tokens, skip) for skip in (ref.end, ref.special)]
    return None if None in found else found[0]


def _misaligned(ref: Reference, chunks: list[tuple[str, int]], tokens: list[Token], skip: set[int]) -> str | None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds back an unfinished character
    at, sent, spelled = 0, "", ""
    for k, (piece, count) in enumerate(chunks):
        for tok in tokens[at : at + count]:
            token_id = ref.id_of(tok)
            if token_id is None:  # a token that does not say which it is: the bytes probe's to report
                return None
            if token_id not in skip:
                spelled += decoder.decode(token_bytes(tok.text, tok.bytes))
        at += count
        sent += piece
        if not spelled.startswith(sent):
            return (
                f"chunk {k} sends text {piece!r} while the tokens streamed so far spell "
                f"{spelled[-40:]!r}: the streamed logprobs are not the streamed text's"
            )
    spelled += decoder.decode(b"", final=True)
    if spelled != sent:
        return f"the streamed tokens spell {spelled[-60:]!r}, the streamed text ends {sent[-60:]!r}"
    return None
