"""Token text made visible: whitespace, control characters and byte pieces."""

from __future__ import annotations

import math
from functools import lru_cache

_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "\\r"}
_LAYOUT = {"\u2028", "\u2029", *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))}

# probability thresholds -> colour, from most to least likely
SCALE = [(0.9, "green"), (0.5, "chartreuse3"), (0.2, "yellow"), (0.05, "dark_orange"), (0.0, "red")]


@lru_cache(maxsize=1 << 16)  # a long trace shows the same token texts many times
def escape(text: str) -> str:
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        elif ch in _LAYOUT:  # line separators and bidi controls would break (or reverse) a table row
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def show_bytes(raw: bytes | list[int]) -> str:
    """A token's own bytes as text; bytes that are not whole UTF-8 characters as <0xNN>."""
    data = bytes(raw)
    try:
        return escape(data.decode("utf-8"))
    except UnicodeDecodeError:
        pass
    out, i = [], 0
    while i < len(data):
        for size in (4, 3, 2, 1):
            chunk = data[i : i + size]
            try:
                out.append(escape(chunk.decode("utf-8")))
                i += len(chunk)
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(f"<0x{data[i]:02X}>")
            i += 1
    return "".join(out)


def prob(logprob: float | None) -> float:
    return 0.0 if logprob is None or math.isinf(logprob) else math.exp(logprob)


def colour(p: float) -> str:
    for threshold, name in SCALE:
        if p >= threshold:
            return name
    return SCALE[-1][1]


def human(n: float) -> str:
    """Bytes in binary units: 45.00 KiB, 1.41 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
