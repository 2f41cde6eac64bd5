"""What a policy is: a spec (name and parameters), the cache it decodes with, and the rule
applied after every forward pass (prefill included), once that pass's attention is done."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.capture import Recorder


@dataclass
class Param:
    """One spec parameter: its kind ("int", "budget" = fraction in (0, 1) or a count >= 1,
    "choice"), default, and lower bound or choices."""

    kind: str
    default: Any
    low: int = 1
    choices: tuple[str, ...] = ()
    quiet: bool = False  # left out of the canonical spec while at its default


@dataclass
class Policy:
    """A cache policy; subclasses set `name`, `params` and override the hooks."""

    values: dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = ""
    params: ClassVar[dict[str, Param]] = {}
    needs_attention: ClassVar[bool] = False
    evicting: ClassVar[bool] = True
    about: ClassVar[str] = ""

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    @property
    def spec(self) -> str:
        """The canonical spec, every parameter written out: `streaming:sinks=4,window=32`."""
        shown = {k: v for k, v in self.values.items() if not (self.params[k].quiet and v == self.params[k].default)}
        if not shown:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in shown.items())

    @property
    def rerotates(self) -> bool:
        """StreamingLLM's positions within the cache: keys re-rotated after each eviction."""
        return bool(self.values.get("rerotate", 0))

    def validate(self) -> None:
        """Checks across parameters, after each was parsed."""

    def recorder(self) -> Recorder | None:
        """The attention this policy reads, or None."""
        return None

    def make_cache(self, model: Any) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)

    def reset(self) -> None:
        """Forgets per-run state (accumulated scores), before a new run."""

    def after_forward(self, lab: LabCache, recorder: Recorder | None, prefill: bool) -> None:
        """Evicts what the rule says; the default keeps everything."""

    def layer_formula(self, kv_heads: int, head_dim: int, dtype_size: int, batch: int = 1):
        """bytes(layer, slots, residual) for this policy's storage: keys and values of the kept
        slots (`residual`: those a quantized layer still holds in full precision)."""
        per_slot = 2 * batch * kv_heads * head_dim * dtype_size
        return lambda layer, slots, residual=0: slots * per_slot


REROTATE = Param("int", 0, low=0, quiet=True)


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def count(budget: float | int, seen: int) -> int:
    """Slots a budget allows after `seen` positions: a fraction of them (at least 1), or a count."""
    if isinstance(budget, float) and budget < 1:
        return min(seen, max(1, math.ceil(budget * seen)))
    return min(seen, int(budget))


def evict_layers(lab: LabCache, keep: Any) -> None:
    """Applies `keep(layer_index, positions) -> bool mask over slots` to every full-attention
    layer (a sliding-window layer already keeps only its window, by transformers' rule)."""
    for i, positions in enumerate(lab.positions):
        if lab.sliding(i):
            continue
        mask = keep(i, positions)
        if not bool(mask.all()):
            lab.keep(i, torch.nonzero(mask).flatten())


def top_slots(scores: torch.Tensor, k: int, protected: torch.Tensor) -> torch.Tensor:
    """Bool mask: `protected` slots plus the `k` highest-scoring others (ties: the earlier slot)."""
    keep = protected.clone()
    if k <= 0:
        return keep
    masked = scores.float().masked_fill(protected, float("-inf"))
    # a stable sort on the negated scores: equal scores keep the earlier slot
    order = torch.sort(-masked, stable=True).indices[:k]
    keep[order] = True
    return keep & torch.isfinite(masked) | protected


def invalid(policy: str, message: str) -> InvalidParameter:
    return InvalidParameter(f"policy {policy}: {message}")
