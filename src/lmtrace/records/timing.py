"""A trace's `timing`, built in one place: the prefill's and the decode steps' milliseconds and
the rates they give, from each step's time (the first step's is the prefill's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def timing(
    times: Sequence[float] | None, prompt_tokens: int, generated_tokens: int | None = None, **extra: Any
) -> dict[str, Any]:
    """{prefill_ms, decode_ms, total_ms, prompt_tokens, generated_tokens, prefill_tokens_per_s,
    decode_tokens_per_s} and `extra` (a source, the rounds of a watched loop). `times` None: the
    steps were not timed (model.generate's output), the times and rates are None."""
    if times is None:
        out = {
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated_tokens or 0,
            "prefill_ms": None,
            "decode_ms": None,
            "total_ms": None,
        }
        return {**out, **extra}
    decode_ms = sum(times[1:])
    n = len(times) if generated_tokens is None else generated_tokens
    out = {
        "prefill_ms": times[0] if times else 0.0,
        "decode_ms": decode_ms,
        "total_ms": sum(times),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": n,
        "prefill_tokens_per_s": prompt_tokens / (times[0] / 1000) if times and times[0] > 0 else None,
        "decode_tokens_per_s": (n - 1) / (decode_ms / 1000) if decode_ms > 0 else None,
    }
    return {**out, **extra}
