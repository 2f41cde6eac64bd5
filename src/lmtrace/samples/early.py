"""DeepConf's online early stop (arXiv 2508.15260, Algorithm 2; facebookresearch/deepconf's
deepconf-online.py): warm-up traces decoded in full set the threshold at a percentile of their
lowest group confidence (DeepConf-low: the 90th, keeping the top 10%; DeepConf-high: the 10th,
keeping the top 90%); every later row is stopped as soon as its current group confidence (the
mean raw token confidence over its last min(window, max_new_tokens) tokens) falls below the
threshold, and sampling stops once the kept traces' confidence-weighted vote reaches consensus."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from lmtrace.decode.row_state import StopRow
from lmtrace.records import Step


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(at), math.ceil(at)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


class Online:
    """The final phase's shared state: the threshold, the group size, and whether consensus ended
    sampling. `stopper()` makes one row's on_step."""

    def __init__(self, threshold: float, window: int, max_new_tokens: int):
        self.threshold = threshold
        self.group = min(window, max_new_tokens)
        self.ended = False  # consensus reached: every row still decoding stops at its next step

    def stopper(self, stops: list[str | None], row: int) -> Callable[[Step], None]:
        """Row `row`'s on_step: StopRow("deepconf") once its current group confidence is below the
        threshold, StopRow("consensus") once sampling has ended; the reason lands in stops[row]
        (also where the row ends at that very step by itself)."""
        recent: list[float] = []

        def step(s: Step) -> None:
            recent.append(s.entries["uncertainty"]["confidence"])
            if len(recent) > self.group:
                recent.pop(0)
            if self.ended:
                stops[row] = "consensus"
            elif len(recent) == self.group and math.fsum(recent) / self.group < self.threshold:
                stops[row] = "deepconf"
            if stops[row] is not None:
                raise StopRow(stops[row])

        return step
