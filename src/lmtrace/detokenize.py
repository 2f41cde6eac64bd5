"""Per-token text pieces that join to exactly `tokenizer.decode(generated_ids)`, and each
token's raw bytes.

Byte-level tokenizers split a Chinese character or an emoji over several tokens. A piece is
empty while the decoded text ends in an incomplete character (U+FFFD), and carries the whole
character once it is complete."""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder maps bytes to characters (GPT-2's ByteLevel, alone or in a
    Sequence). Reads the decoder's own state, tens of bytes, not the whole tokenizer serialised
    (its vocabulary and merges: 0.31 s for the bundled model's, at each first call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = backend.decoder
        state = decoder.__getstate__() if decoder is not None else b""
    except Exception:  # a tokenizer that cannot serialise its decoder: treat as non byte-level
        return False
    return "ByteLevel" in (state.decode() if isinstance(state, bytes) else str(state))


# per tokenizer: (byte-level?, special ids, id -> bytes), worked out once per tokenizer
_SHARED: weakref.WeakKeyDictionary[Any, tuple[bool, set[int], dict[int, bytes]]] = weakref.WeakKeyDictionary()


class TokenBytes:
    """Maps token ids to their raw bytes, cached per id (and shared by all users of a tokenizer)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        try:
            shared = _SHARED.get(tokenizer)
        except TypeError:  # not weak-referenceable: no sharing
            shared = None
        if shared is None:
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            shared = (_is_byte_level(tokenizer), special, {})
            try:
                _SHARED[tokenizer] = shared
            except TypeError:
                pass
        self.byte_level, self.special, self._cache = shared

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._compute(token_id)
            self._cache[token_id] = found
        return found

    def _compute(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.special:
            return piece.encode("utf-8")
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        table = _byte_decoder()
        if self.byte_level and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode("utf-8")

    def text(self, token_id: int) -> str:
        """The token on its own, as text (invalid UTF-8 bytes become U+FFFD)."""
        return self(token_id).decode("utf-8", errors="replace")


def pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's text piece, as IncrementalDetokenizer gives them, the last one with whatever
    was held back (an incomplete character): they concatenate to exactly decode(ids)."""
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]


class IncrementalDetokenizer:
    """Feeds token ids one at a time and returns the text each one adds."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        return self._advance(final)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        # Decoding the whole sequence keeps the pieces exactly consistent with decode();
        # the cost is quadratic in the length but small next to a forward pass.
        full = self.tokenizer.decode(self.ids)
        if not full.startswith(self.emitted):
            return ""  # the tokenizer rewrote earlier text; hold until it agrees again
        ready = full if final else full.rstrip(REPLACEMENT)
        piece = ready[len(self.emitted) :]
        self.emitted = ready if len(ready) > len(self.emitted) else self.emitted
        return piece
