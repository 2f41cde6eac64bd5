"""`window:size=N`: only the N most recent positions (a plain sliding window; the first
tokens go once the window has passed them). `rerotate=1`: positions within the cache, as for
streaming."""

from __future__ import annotations

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import REROTATE, Param, Policy, evict_layers, invalid


class Window(Policy):
    name = "window"
    params = {"size": Param("int", 32), "rerotate": REROTATE}
    about = "the most recent `size` positions"

    def validate(self) -> None:
        if self["rerotate"] not in (0, 1):
            raise invalid(self.name, f"rerotate must be 0 or 1, got {self['rerotate']}")

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        size = self["size"]
        evict_layers(lab, lambda i, pos: pos > pos[-1] - size)
