"""`fp8`: keys and values stored as float8_e4m3fn with one float32 scale per tensor (bare
torch, transformers' Fp8QuantizedLayer); the scale is set by the prompt and frozen after."""

from __future__ import annotations

from typing import Any

from lmtrace.kvlab.policies.base import Policy


class Fp8(Policy):
    name = "fp8"
    evicting = False
    about = "every position, stored as float8 (e4m3) with a per-tensor scale"

    def make_cache(self, model: Any) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache(backend="fp8", config=model.config)

    def layer_formula(self, kv_heads: int, head_dim: int, dtype_size: int, batch: int = 1):
        per_slot = 2 * batch * kv_heads * head_dim  # one byte per element
        scales = 2 * 4  # the keys' and the values' float32 scales
        return lambda layer, slots, residual=0: slots * per_slot + (scales if slots else 0)
