"""The only reader of transformers' cache internals (they change between versions).

transformers 5.x: a DynamicCache holds `cache.layers[i].keys / .values`, each
(batch, num_kv_heads, seq_len, head_dim). A sliding-window layer keeps fewer positions than
`get_seq_length()` counts, so bytes are always measured from the tensors themselves."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class KVState:
    """The cache after one forward pass: positions seen and bytes held over all layers."""

    seq_len: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "bytes": self.bytes}


def new_cache(model: Any) -> DynamicCache:
    return DynamicCache(config=model.config)


@lru_cache(maxsize=32)
def _forward_kwarg(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: DynamicCache) -> dict[str, Any]:
    """The forward keyword for the cache: recent 5.x releases say `cache=`, older ones
    `past_key_values=`."""
    return {_forward_kwarg(type(model)): cache, "use_cache": True}


def _layer_tensors(layer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return getattr(layer, "keys", None), getattr(layer, "values", None)


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None or not isinstance(t, torch.Tensor):
        return 0
    return t.numel() * t.element_size()


def seq_length(cache: DynamicCache) -> int:
    """Positions seen by the cache (counts every token, also past a sliding window)."""
    return int(cache.get_seq_length())


def state(cache: DynamicCache) -> KVState:
    total = 0
    for layer in cache.layers:
        k, v = _layer_tensors(layer)
        total += _nbytes(k) + _nbytes(v)
    return KVState(seq_len=seq_length(cache), bytes=total)
