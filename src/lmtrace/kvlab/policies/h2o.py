"""`h2o:budget=B,recent=R`: Heavy-Hitter Oracle (Zhang et al., 2023). Every slot accumulates
the attention it receives (all queries of the prefill, then each step's query; mean over
heads); after each pass the cache keeps `budget` slots: the most recent R of them (a fraction
of the budget) and the heaviest hitters among the older ones. A budget below 1 is a fraction of
the positions seen so far, a whole number a count of slots."""

from __future__ import annotations

import torch

from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder
from lmtrace.kvlab.policies.base import Param, Policy, count, evict_layers, invalid, top_slots


class H2O(Policy):
    name = "h2o"
    params = {"budget": Param("budget", 0.25), "recent": Param("fraction", 0.5)}
    needs_attention = True
    about = "accumulated attention (heavy hitters) plus recent positions, `budget` slots"

    def validate(self) -> None:
        if not 0.0 <= self["recent"] <= 1.0:
            raise invalid(self.name, f"recent must be a fraction in [0, 1], got {self['recent']}")

    def reset(self) -> None:
        self.scores: list[torch.Tensor | None] = []

    def recorder(self) -> Recorder:
        return Recorder(total=True)

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        if not getattr(self, "scores", None):
            self.scores = [None] * len(lab.positions)

        def keep(i: int, pos: torch.Tensor) -> torch.Tensor:
            got = recorder.total[i][0].cpu()  # (slots,) what this pass's queries gave each slot
            old = self.scores[i]
            acc = got.clone()
            if old is not None:
                acc[: old.numel()] += old  # slots appended this pass start from zero
            k = count(self["budget"], int(pos[-1]) + 1)
            recent = min(k, round(k * self["recent"]))
            protected = torch.zeros(pos.numel(), dtype=torch.bool)
            if recent:
                protected[-recent:] = True
            mask = top_slots(acc, k - recent, protected)
            self.scores[i] = acc[mask]
            return mask

        evict_layers(lab, keep)
