"""KV-cache arithmetic from a config alone: where each dimension comes from, bytes per token,
bytes at a context length. The formula, for full-attention layers:

    bytes = 2 (keys and values) × layers × kv_heads × head_dim × positions × batch × bytes_per_element

A sliding-window layer holds min(positions, window - 1) positions; a layer without a cache none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger
from lmtrace.model.arch import attention_kind, text_config

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}


class UnsupportedCacheLayout(InvalidParameter):
    """The config uses a cache layout this calculator does not know; no number is better than a wrong one."""


def element_size(dtype: str) -> int:
    if dtype not in BYTES_PER_ELEMENT:
        raise InvalidParameter(f"dtype must be one of {', '.join(BYTES_PER_ELEMENT)}, got {dtype!r}")
    return BYTES_PER_ELEMENT[dtype]


@dataclass
class Anatomy:
    """The cache dimensions of one model, explained with its own config numbers."""

    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    attention: str
    dtype: str
    bytes_per_element: int
    batch: int
    specs: list[ledger.LayerSpec]
    sources: dict[str, str]

    def bytes_at(self, positions: int) -> int:
        """Bytes of the whole cache (all layers, keys and values, the batch) after `positions` tokens."""
        per_row = sum(2 * s.kv_heads * s.head_dim * s.held(positions) for s in self.specs)
        return per_row * self.batch * self.bytes_per_element

    @property
    def bytes_per_token(self) -> int:
        """Growth per token of one sequence while no sliding window is full."""
        return sum(2 * s.kv_heads * s.head_dim for s in self.specs if s.kind != "none") * self.bytes_per_element

    @property
    def bytes_per_token_full(self) -> int:
        """Growth per token of one sequence once every sliding window is full: only the
        full-attention layers still grow."""
        return sum(2 * s.kv_heads * s.head_dim for s in self.specs if s.kind == ledger.FULL) * self.bytes_per_element

    def growth_at(self, positions: int) -> int:
        """Bytes one sequence's cache grows by with its `positions`-th token (1-based)."""
        grows = [s for s in self.specs if s.held(positions) > s.held(positions - 1)]
        return sum(2 * s.kv_heads * s.head_dim for s in grows) * self.bytes_per_element

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s.window]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s.kind == ledger.FULL]

    def groups(self) -> list[dict[str, Any]]:
        """Layers with the same cache shape: {kind, window, kv_heads, head_dim, layers: [indices]},
        in the order of their first layer (layers without a cache left out)."""
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        for i, s in enumerate(self.specs):
            if s.kind == "none":
                continue
            key = (s.kind, s.window, s.kv_heads, s.head_dim)
            group = out.setdefault(
                key, {"kind": s.kind, "window": s.window, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "layers": []}
            )
            group["layers"].append(i)
        return list(out.values())

    def formula(self) -> str:
        """The formula in words with this model's numbers; one term per group of layers."""
        tail = f" × {self.batch} batch × {self.bytes_per_element} bytes ({self.dtype})"
        groups = sorted(self.groups(), key=lambda g: bool(g["window"]))  # full layers first
        if len(groups) == 1 and not groups[0]["window"] and len(groups[0]["layers"]) == self.layers:
            return (
                f"bytes = 2 × {self.layers} layers × {self.kv_heads} kv_heads × {self.head_dim} head_dim"
                f" × positions" + tail
            )
        terms = [
            f"{len(g['layers'])} {'sliding' if g['window'] else 'full'} layers × {g['kv_heads']} kv_heads"
            f" × {g['head_dim']} head_dim × " + (f"min(positions, {g['window'] - 1})" if g["window"] else "positions")
            for g in groups
        ]
        return "bytes = 2 × (" + " + ".join(terms) + ")" + tail

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "attention_heads": self.attention_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "attention": self.attention,
            "dtype": self.dtype,
            "bytes_per_element": self.bytes_per_element,
            "batch": self.batch,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_token_full": self.bytes_per_token_full,
            "sliding_layers": self.sliding_layers,
            "full_layers": self.full_layers,
            "groups": self.groups(),
            "windows": sorted({s.window for s in self.specs if s.window}),
            "sources": self.sources,
            "formula": self.formula(),
        }


def _sources(c: Any, heads: int, head_dim: int) -> dict[str, str]:
    derived = c.hidden_size // heads
    if getattr(c, "head_dim", None) and int(c.head_dim) != derived:
        hd = f"head_dim = {head_dim} (explicit; hidden_size / num_attention_heads would give {derived})"
    else:
        hd = f"head_dim = hidden_size / num_attention_heads = {c.hidden_size} / {heads} = {head_dim}"
    kvh = getattr(c, "num_key_value_heads", None)
    return {
        "layers": f"num_hidden_layers = {c.num_hidden_layers}",
        "kv_heads": f"num_key_value_heads = {kvh}"
        if kvh
        else f"num_attention_heads = {heads} (no num_key_value_heads)",
        "head_dim": hd,
        "batch": "the number of sequences decoded together",
        "positions": "prompt tokens + generated tokens (capped at window - 1 on sliding-window layers)",
    }


def anatomy(config: Any, dtype: str = "float32", batch: int = 1) -> Anatomy:
    """The cache anatomy of `config`; raises UnsupportedCacheLayout where it would be wrong."""
    c = text_config(config)
    if getattr(c, "kv_lora_rank", None):
        raise UnsupportedCacheLayout(
            f"{config.model_type}: multi-head latent attention (kv_lora_rank {c.kv_lora_rank}) caches a compressed "
            "latent, not keys and values per head; its size is not computed here"
        )
    specs = ledger.layer_layout(config)
    unknown = sorted({s.kind for s in specs} - {ledger.FULL, ledger.SLIDING, "none"})
    if unknown:
        raise UnsupportedCacheLayout(
            f"{config.model_type}: layer type {unknown[0]!r} keeps a cache this calculator does not know"
        )
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return Anatomy(
        layers=len(specs),
        attention_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=int(c.hidden_size),
        attention=attention_kind(heads, kv_heads),
        dtype=dtype,
        bytes_per_element=element_size(dtype),
        batch=batch,
        specs=specs,
        sources=_sources(c, heads, head_dim),
    )


def context_table(an: Anatomy, max_context: int | None) -> list[dict[str, int]]:
    """Sizes at 1k, 2k, 4k, … up to the model's maximum (included)."""
    top = max_context or 131072
    sizes, n = [], 1024
    while n < top:
        sizes.append(n)
        n *= 2
    sizes.append(top)
    return [{"context": s, "bytes": an.bytes_at(s)} for s in sizes]
