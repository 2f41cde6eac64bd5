"""`streaming:sinks=S,window=N`: StreamingLLM (Xiao et al., 2023): the first S positions (the
attention sinks) plus the N most recent."""

from __future__ import annotations

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import Param, Policy, evict_layers


class Streaming(Policy):
    name = "streaming"
    params = {"sinks": Param("int", 4, low=0), "window": Param("int", 32)}
    about = "the first `sinks` positions and the most recent `window`"

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        sinks, window = self["sinks"], self["window"]
        evict_layers(lab, lambda i, pos: (pos < sinks) | (pos > pos[-1] - window))
