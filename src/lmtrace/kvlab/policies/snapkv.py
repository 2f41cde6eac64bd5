"""`snapkv:budget=B,window=W,kernel=K`: SnapKV (Li et al., 2024): once, after the prefill, the
prompt is compressed to `budget` slots: the last W prompt positions (the observation window)
and the prompt positions those W queries attend to most (summed, mean over heads, smoothed by
a max-pool of width K). Generated tokens are then all kept."""

from __future__ import annotations

import torch

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import Param, Policy, count, evict_layers, top_slots


class SnapKV(Policy):
    name = "snapkv"
    params = {"budget": Param("budget", 0.25), "window": Param("int", 8), "kernel": Param("int", 1)}
    needs_attention = True
    about = "the prompt compressed once to `budget` slots by an observation window's attention"

    def recorder(self) -> Recorder:
        return Recorder(window=self["window"])

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        if not prefill:
            return

        def keep(i: int, pos: torch.Tensor) -> torch.Tensor:
            k = count(self["budget"], pos.numel())
            votes = recorder.window_sum[i][0].cpu()  # (slots,)
            kernel = self["kernel"]
            if kernel > 1:  # keeps a chosen position's neighbours too, as the paper's pooling
                votes = torch.nn.functional.max_pool1d(votes[None, None], kernel, 1, kernel // 2)[0, 0, : pos.numel()]
            window = min(self["window"], k)
            protected = torch.zeros(pos.numel(), dtype=torch.bool)
            protected[pos.numel() - window :] = True
            return top_slots(votes, k - window, protected)

        evict_layers(lab, keep)
