"""`tova:budget=B`: Token Omission Via Attention (Oren et al., 2024): once the cache holds more
than `budget` slots, drop the ones the current query attends to least (mean over heads)."""

from __future__ import annotations

import torch

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import Param, Policy, count, evict_layers, top_slots


class Tova(Policy):
    name = "tova"
    params = {"budget": Param("budget", 0.25)}
    needs_attention = True
    about = "the `budget` slots the last query attends to most"

    def recorder(self) -> Recorder:
        return Recorder()

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        def keep(i: int, pos: torch.Tensor) -> torch.Tensor:
            k = count(self["budget"], int(pos[-1]) + 1)
            last = recorder.last[i][0].cpu()  # (slots,)
            protected = torch.zeros(pos.numel(), dtype=torch.bool)
            protected[-1] = True  # the token just fed stays (its own query's key)
            return top_slots(last, k - 1, protected)

        evict_layers(lab, keep)
