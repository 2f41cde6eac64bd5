"""`knorm:budget=B`: keep the slots whose keys have the smallest L2 norm (mean over KV heads):
low-norm keys draw the most attention (Devoto et al., 2024); no attention weights needed."""

from __future__ import annotations

import torch

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import Param, Policy, count, evict_layers, top_slots


class Knorm(Policy):
    name = "knorm"
    params = {"budget": Param("budget", 0.25)}
    about = "the `budget` slots with the smallest key norms"

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        def keep(i: int, pos: torch.Tensor) -> torch.Tensor:
            k = count(self["budget"], int(pos[-1]) + 1)
            norms = lab.keys(i)[0].float().norm(dim=-1).mean(dim=0).cpu()  # (heads, slots, d) -> (slots,)
            protected = torch.zeros(pos.numel(), dtype=torch.bool)
            protected[-1] = True
            return top_slots(-norms, k - 1, protected)

        evict_layers(lab, keep)
