"""The settings of `sample` besides its prompt, count and sampling params (`SampleOptions`), and
the checks of its DeepConf early stop, run before any model loads (no torch)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmtrace.errors import InvalidParameter

# DeepConf's percentile of the warm-up's lowest group confidences, by variant (its repo's
# CONFIDENCE_PERCENTILE: 90 for DeepConf-low, 10 for DeepConf-high)
PERCENTILE = {"low": 90.0, "high": 10.0}
# and the share of the traces each variant keeps (eta, in percent), for the offline filter
ETA = {"low": 10.0, "high": 90.0}


@dataclass(frozen=True)
class SampleOptions:
    """What `sample` takes besides the prompt, `n` and the sampling settings. `answer_regex`: the
    answer is its first group (else the whole match). `choice`: each sample constrained to one of
    these options. `deepconf` "low" or "high": DeepConf's online early stop after `warmup` traces,
    ending at `consensus`. `confidence_k`, `confidence_window`, `confidence_tail`: the uncertainty
    observer's settings. `max_batch` rows decode at once; `on_row(i, trace)` hears each finish."""

    answer_regex: str | None = None
    choice: Sequence[str] = ()
    deepconf: str | None = None
    warmup: int | None = None
    consensus: float = 0.95
    confidence_k: int = 20
    confidence_window: int = 2048
    confidence_tail: int = 2048
    chat: bool = False
    max_batch: int = 16
    on_row: Callable[[int, Any], None] | None = None


def check(mode: str | None, warmup: int | None, n: int, consensus: float) -> None:
    """The early stop's settings: a known variant, 1 <= warmup <= n, consensus in (0, 1]."""
    if mode is not None and mode not in PERCENTILE:
        raise InvalidParameter(f"deepconf must be 'low' or 'high', got {mode!r}")
    if warmup is not None and (mode is None or not 1 <= warmup <= n):
        detail = "needs --deepconf" if mode is None else f"must be in [1, n={n}]"
        raise InvalidParameter(f"warmup {detail}, got {warmup}")
    if not 0 < consensus <= 1:
        raise InvalidParameter(f"consensus must be in (0, 1], got {consensus}")


def warmup_size(n: int, warmup: int | None) -> int:
    """The warm-up traces: as asked, else a quarter of the samples (at least one)."""
    return warmup if warmup is not None else max(1, math.ceil(n / 4))
