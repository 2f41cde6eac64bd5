"""`window:size=N`: only the N most recent positions (a plain sliding window; the first
tokens go once the window has passed them)."""

from __future__ import annotations

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import Param, Policy, evict_layers


class Window(Policy):
    name = "window"
    params = {"size": Param("int", 32)}
    about = "the most recent `size` positions"

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        size = self["size"]
        evict_layers(lab, lambda i, pos: pos > pos[-1] - size)
