"""`streaming:sinks=S,window=N`: StreamingLLM (Xiao et al., 2023): the first S positions (the
attention sinks) plus the N most recent. With `rerotate=1` the positions are those within the
cache, as in the paper: each new token is fed at the cache's length and the kept keys are
re-rotated onto their slots after each eviction (default: original positions kept)."""

from __future__ import annotations

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import REROTATE, Param, Policy, evict_layers, invalid


class Streaming(Policy):
    name = "streaming"
    params = {"sinks": Param("int", 4, low=0), "window": Param("int", 32), "rerotate": REROTATE}
    about = "the first `sinks` positions and the most recent `window`"

    def validate(self) -> None:
        if self["rerotate"] not in (0, 1):
            raise invalid(self.name, f"rerotate must be 0 or 1, got {self['rerotate']}")

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        sinks, window = self["sinks"], self["window"]
        evict_layers(lab, lambda i, pos: (pos < sinks) | (pos > pos[-1] - window))
