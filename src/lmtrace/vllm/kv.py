"""The KV cache of a vLLM request, from vLLM's own numbers where it exposes them.

vLLM keeps the cache in fixed-size blocks (its `block_size`, from the engine's config) and gives
a request ceil(positions / block_size) of them; it does not expose a request's tensors, so the
bytes of a block come from the formula (2 x layers x kv_heads x head_dim x block_size x bytes per
element, lmtrace.kv.size), marked as such in the record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmtrace.kv import size as kvsize

SOURCE = "vllm block_size and blocks; bytes per token from the formula (lmtrace.kv.size)"


@dataclass
class KVLayout:
    """The engine's paged cache: its block size and capacity (None where vLLM did not say)."""

    block_size: int | None
    num_blocks: int | None
    bytes_per_token: int | None
    dtype: str
    device: str
    prefix_caching: bool = False

    @property
    def bytes_per_block(self) -> int | None:
        if self.block_size is None or self.bytes_per_token is None:
            return None
        return self.block_size * self.bytes_per_token

    def header(self) -> dict[str, Any]:
        per_block = self.bytes_per_block
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "bytes_per_block": self.bytes_per_block,
            "capacity_bytes": self.num_blocks * per_block if self.num_blocks and per_block else None,
            "prefix_caching": self.prefix_caching,
            "source": SOURCE,
        }

    def step(self, positions: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The cache of one request after the forward pass that saw `positions` tokens."""
        per_token = self.bytes_per_token or 0
        used = positions * per_token
        d: dict[str, Any] = {"seq_len": positions, "bytes": used, "expected_bytes": used}
        if self.block_size:
            blocks = -(-positions // self.block_size)  # ceil
            d["bytes"] = blocks * self.block_size * per_token
            d["bytes_used"] = used
            d["blocks"] = {"count": blocks, "block_size": self.block_size, "prefix_cached_tokens": cached_tokens}
        d["source"] = SOURCE if self.block_size else "the formula (lmtrace.kv.size)"
        return d


def layout(engine_config: Any, model_config: Any, dtype: str, device: str) -> KVLayout:
    """From a vLLM engine's `vllm_config` (`cache_config.block_size`, `num_gpu_blocks`)."""
    cache = getattr(engine_config, "cache_config", None)
    block_size = getattr(cache, "block_size", None)
    num_blocks = getattr(cache, "num_gpu_blocks", None)
    kv_dtype = getattr(cache, "cache_dtype", "auto")
    try:
        per_token = kvsize.anatomy(model_config, dtype if kv_dtype == "auto" else str(kv_dtype), 1).bytes_per_token
    except kvsize.InvalidParameter:
        per_token = None
    prefix = bool(getattr(cache, "enable_prefix_caching", False))
    return KVLayout(block_size, num_blocks, per_token, dtype, device, prefix)
