"""The only reader of transformers' cache internals (they change between versions).

transformers 5.x: a DynamicCache holds `cache.layers[i].keys / .values`, each
(batch, num_kv_heads, seq_len, head_dim). A sliding-window layer keeps `sliding_window - 1`
positions while `get_seq_length()` counts every token seen, so bytes are always measured from
the tensors themselves and checked against the formula of kvsize.py."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

FULL, SLIDING = "full_attention", "sliding_window"


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's cache looks like, from the config alone."""

    kind: str  # "full_attention", "sliding_window", "none" (no KV cache), or an unsupported type's name
    kv_heads: int
    head_dim: int
    window: int | None = None

    def held(self, seen: int) -> int:
        """Positions this layer keeps after `seen` tokens (transformers keeps window - 1)."""
        if self.kind == "none":
            return 0
        return min(seen, self.window - 1) if self.window else seen


@dataclass
class KVState:
    """The cache after one forward pass: positions seen, bytes allocated and holding tokens
    (they differ for a preallocated static cache), and per-layer detail."""

    seq_len: int
    bytes: int
    expected_bytes: int | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    bytes_used: int | None = None

    @property
    def matches(self) -> bool:
        used = self.bytes if self.bytes_used is None else self.bytes_used
        return self.expected_bytes is None or self.expected_bytes == used

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"seq_len": self.seq_len, "bytes": self.bytes}
        if self.bytes_used is not None and self.bytes_used != self.bytes:
            d["bytes_used"] = self.bytes_used
        if self.expected_bytes is not None:
            d["expected_bytes"] = self.expected_bytes
        if self.layers:
            d["layers"] = self.layers
        return d


def new_cache(model: Any, static_len: int | None = None, croppable: bool = False) -> Any:
    """A DynamicCache, or a StaticCache of `static_len` positions (preallocated, for compiling).
    `croppable`: a sliding-window layer keeps its past until `crop` (speculative decoding)."""
    if static_len is not None:  # a static layer crops by moving its fill mark back
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=static_len)
    cache = DynamicCache(config=model.config)
    if croppable and hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


@lru_cache(maxsize=32)
def _forward_kwarg(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: DynamicCache) -> dict[str, Any]:
    """The forward keyword for the cache: recent 5.x releases say `cache=`, older ones
    `past_key_values=`."""
    return {_forward_kwarg(type(model)): cache, "use_cache": True}


def cache_of(model: Any, layers: Any) -> DynamicCache:
    """A DynamicCache holding the given keys and values, per layer (batch, kv_heads, len,
    head_dim), without copying them (a cache made from rows computed elsewhere)."""
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in zip(cache.layers, layers):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), (batch, kv_heads, len, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def find_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a forward call was given, under either name."""
    found = kwargs.get("cache")
    return found if found is not None else kwargs.get("past_key_values")


def layer_types_and_kwargs(text: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """(layer types, per-layer kwargs) of a text config as transformers' DynamicCache(config=...)
    builds its layers, in every 5.x: 5.18 on, `get_layer_types_and_kwargs` gives a kwargs dict per
    layer; 5.1-5.17 one dict for all layers; 5.0 has no such function (the cache's own layers
    are read: a sliding one has `is_sliding` and its `sliding_window`)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        return built_layers(text)
    types, kwargs = get_layer_types_and_kwargs(text)
    if isinstance(kwargs, dict):  # one dict, the same for every layer
        return list(types), [kwargs] * len(types)
    return list(types), list(kwargs)


def built_layers(text: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """(layer types, per-layer kwargs) read off the layers DynamicCache(config=text) builds: a
    sliding (or chunked) layer has `is_sliding` and its `sliding_window`, any other is full."""
    layers = DynamicCache(config=text).layers
    types = ["sliding_attention" if getattr(layer, "is_sliding", False) else FULL for layer in layers]
    return types, [{"sliding_window": getattr(layer, "sliding_window", None)} for layer in layers]


def layer_layout(config: Any) -> list[LayerSpec]:
    """Per-layer cache specs as transformers' DynamicCache(config=...) would build them."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, kwargs = layer_types_and_kwargs(text)
    per_layer = getattr(text, "per_layer_config", None)
    specs = []
    for i, (kind, kw) in enumerate(zip(types, kwargs)):
        cfg = per_layer[i] if per_layer is not None else text
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if kind == FULL:
            specs.append(LayerSpec(FULL, kv_heads, head_dim))
        elif kind in ("sliding_attention", "chunked_attention"):
            specs.append(LayerSpec(SLIDING, kv_heads, head_dim, int(kw["sliding_window"])))
        elif kind == "dummy":  # shares another layer's cache, or has no attention
            specs.append(LayerSpec("none", kv_heads, head_dim))
        else:
            specs.append(LayerSpec(kind, kv_heads, head_dim))
    return specs


def _nbytes(t: Any) -> int:
    """Bytes held by a tensor, or by the storage a quantized layer keeps: a tensor subclass
    (optimum-quanto's packed QTensor) through its inner tensors, a (tensor, scale) tuple
    (transformers' fp8 layer), a dict of tensors (hqq's metadata)."""
    if isinstance(t, torch.Tensor):
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            names, _ = t.__tensor_flatten__()
            return sum(_nbytes(getattr(t, name)) for name in names)
        return t.numel() * t.element_size()
    if isinstance(t, (tuple, list)):
        return sum(_nbytes(x) for x in t)
    if isinstance(t, dict):
        return sum(_nbytes(x) for x in t.values())
    return 0


def quantized_storage(layer: Any) -> tuple[Any, Any]:
    """(keys, values) a quantized layer keeps outside `.keys/.values` (None, None for others)."""
    return getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)


def _shape(t: Any) -> list[int] | None:
    return list(t.shape) if isinstance(t, torch.Tensor) and t.numel() else None


def _layer_entry(index: int, layer: Any, seen: int | None = None) -> dict[str, Any]:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    held = keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
    filled = min(int(layer.get_seq_length()) if seen is None else seen, held) if held else 0
    allocated = _nbytes(keys) + _nbytes(values)
    qkeys, qvalues = quantized_storage(layer)
    quantized = _nbytes(qkeys) + _nbytes(qvalues)
    if quantized:  # a quantized layer: packed storage plus its full-precision residual, all in use
        entry = {
            "layer": index,
            "kind": FULL,
            "window": None,
            "keys": _shape(keys),
            "values": _shape(values),
            "dtype": _quantized_dtype(qkeys),
            "bytes": allocated + quantized,
            "bytes_used": allocated + quantized,
            "quantized_bytes": quantized,
        }
        return entry
    return {
        "layer": index,
        "kind": SLIDING if getattr(layer, "is_sliding", False) else FULL,
        "window": getattr(layer, "sliding_window", None),
        "keys": _shape(keys),
        "values": _shape(values),
        "dtype": str(keys.dtype).replace("torch.", "") if isinstance(keys, torch.Tensor) else None,
        "bytes": allocated,
        # a static cache allocates its maximum length up front; only `filled` positions hold tokens
        "bytes_used": allocated * filled // held if held else 0,
    }


def _quantized_dtype(q: Any) -> str:
    data = q[0] if isinstance(q, (tuple, list)) else q
    name = getattr(getattr(data, "qtype", None), "name", None)  # optimum-quanto: qint4, qint2
    if name is None and isinstance(data, torch.Tensor):
        name = str(data.dtype).replace("torch.", "")
    return str(name)


def seq_length(cache: Any) -> int:
    """Positions seen by the cache (counts every token, also past a sliding window)."""
    return int(cache.get_seq_length())


def state(cache: Any, expected: Any = None, layers: bool = True, seen: int | None = None) -> KVState:
    """Measures the cache; `expected(seq_len) -> bytes` is the formula to check against. `seen`:
    the positions the caller knows the cache holds (a static cache's full-attention layers, whose
    counter lives on the device: reading it would wait for the step in flight)."""
    entries = [_layer_entry(i, layer, seen) for i, layer in enumerate(cache.layers)]
    total = sum(e["bytes"] for e in entries)
    seen = seq_length(cache) if seen is None else seen
    return KVState(
        seq_len=seen,
        bytes=total,
        expected_bytes=expected(seen) if expected is not None else None,
        layers=entries if layers else [],
        bytes_used=sum(e["bytes_used"] for e in entries),
    )


def crop(cache: Any, length: int) -> dict[str, int] | None:
    """Cuts the cache back to its first `length` positions (DynamicCache.crop: speculative
    decoding's rejected proposals); returns {from, to, bytes_before, bytes_after} (bytes holding
    tokens: a static cache keeps its allocation), None when nothing was cut."""
    seen = seq_length(cache)
    if length >= seen:
        return None
    before = state(cache, layers=False).bytes_used
    cache.crop(length - seen)  # a negative count: the positions to remove
    after = state(cache, layers=False).bytes_used
    return {"from": seen, "to": length, "bytes_before": before, "bytes_after": after}


def prefix_state(cache: Any, length: int, expected: Any = None) -> KVState:
    """The cache as it stood when it held `length` positions, from its tensors now (one verify
    forward of speculative decoding fills the positions of several steps at once): every
    layer's kept positions and bytes scaled to that length."""
    now = state(cache, expected=None)
    seen = max(now.seq_len, 1)
    layers = []
    for e in now.layers:
        held = e["keys"][2] if e["keys"] else 0
        keep = min(length, (e["window"] - 1) if e["window"] else length, held) if held else 0
        per_position = e["bytes_used"] // held if held else 0
        layers.append(
            {
                **e,
                "keys": _resized(e["keys"], keep),
                "values": _resized(e["values"], keep),
                "bytes": per_position * keep,
                "bytes_used": per_position * keep,
            }
        )
    total = sum(e["bytes"] for e in layers) if layers else now.bytes * length // seen
    return KVState(length, total, expected(length) if expected is not None else None, layers, total)


def _resized(shape: list[int] | None, positions: int) -> list[int] | None:
    return None if shape is None else [*shape[:2], positions, *shape[3:]]


def layer_shapes(cache: Any) -> list[list[int] | None]:
    """Key shapes of every layer, for logs of people's own loops."""
    return [_shape(getattr(layer, "keys", None)) for layer in cache.layers]


# Regrouping a batch's cache while it decodes (continuous batching, lmtrace.decode.continuous): rows
# join (their own cache, left-padded to the batch's width) and leave (selected away).


def regroupable(cache: Any) -> bool:
    """Whether rows can join and leave this cache: only plain full-attention dynamic layers
    (a sliding layer's kept window depends on each row's own length)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keeps the rows `index` (in that order), in place."""
    for layer in cache.layers:
        _hold(layer, layer.keys.index_select(0, index), layer.values.index_select(0, index))


def drop_left(cache: Any, width: int) -> None:
    """Drops the first `width` positions of every row (padding that no row needs any more)."""
    if width <= 0:
        return
    for layer in cache.layers:
        if isinstance(layer, _Room):  # its storage from `width` on: the room after it is kept
            keys, values = layer.storage
            layer.hold(keys[:, :, width:], values[:, :, width:], layer.keys.shape[2] - width)
        else:
            layer.keys, layer.values = layer.keys[:, :, width:], layer.values[:, :, width:]


def join_rows(cache: Any, other: Any) -> None:
    """Appends the rows of `other` after this cache's rows, in place, each left-padded with empty
    positions (masked out) to the longer of the two widths: one copy of each."""
    for layer, extra in zip(cache.layers, other.layers):
        spare = layer.spare if isinstance(layer, _Room) else 0
        keys, values = _stacked(layer.keys, extra.keys, spare), _stacked(layer.values, extra.values, spare)
        _hold(layer, keys, values, keys.shape[2] - spare)


def with_room(cache: Any, spare: int) -> Any:
    """The cache's layers, in place, as layers that grow `spare` positions at a time and write
    each forward's new positions in place (no copy of what they hold at each step)."""
    cache.layers = [_Room(layer.keys, layer.values, spare=spare) for layer in cache.layers]
    return cache


def _hold(layer: Any, keys: torch.Tensor, values: torch.Tensor, used: int | None = None) -> None:
    if isinstance(layer, _Room):
        layer.hold(keys, values, used)
    else:
        layer.keys, layer.values = keys, values


def _stacked(a: torch.Tensor, b: torch.Tensor, spare: int = 0) -> torch.Tensor:
    """(rows a + rows b, kv_heads, width + spare, head_dim), each right-aligned in the first width."""
    width = max(a.shape[2], b.shape[2])
    out = a.new_zeros((a.shape[0] + b.shape[0], a.shape[1], width + spare, a.shape[3]))
    out[: a.shape[0], :, width - a.shape[2] : width] = a
    out[a.shape[0] :, :, width - b.shape[2] : width] = b
    return out


def append_columns(cache: Any, new: Any) -> None:
    """Appends positions after every row's last, in place: per layer (keys, values) of shape
    (batch, kv_heads, positions, head_dim)."""
    for layer, (keys, values) in zip(cache.layers, new):
        layer.keys = torch.cat([layer.keys, keys], dim=-2)
        layer.values = torch.cat([layer.values, values], dim=-2)


class _Room(DynamicLayer):
    """A layer whose storage has room after the positions it holds: a forward writes its new keys
    and values in place (a DynamicLayer copies everything it holds at each forward). Out of
    room, it takes a larger storage with `spare` positions more than it needs."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, used: int | None = None, spare: int = 0):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.spare = spare
        self.hold(keys, values, used)

    def hold(self, keys: torch.Tensor, values: torch.Tensor, used: int | None = None) -> None:
        """Takes these tensors as its storage, the first `used` positions (default all) held."""
        self.storage = (keys, values)
        used = keys.shape[2] if used is None else used
        self.keys, self.values = keys[:, :, :used], values[:, :, :used]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.storage
        used = self.keys.shape[2]
        end = used + key_states.shape[-2]
        if end > keys.shape[2]:
            keys, values = _grown(self.keys, end + self.spare), _grown(self.values, end + self.spare)
        keys[:, :, used:end] = key_states
        values[:, :, used:end] = value_states
        self.hold(keys, values, end)
        return self.keys, self.values


def _grown(t: torch.Tensor, size: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0], t.shape[1], size, t.shape[3]))
    out[:, :, : t.shape[2]] = t
    return out


def cache_with_room(model: Any, parts: Sequence[Any], room: int) -> DynamicCache:
    """A one-row cache holding `parts` one after another, with room for `room` more positions
    written in place. Each part: per layer (keys, values) of (1, kv_heads, len, head_dim), or of
    (rows, kv_heads, len, head_dim): its rows one after another."""
    cache = DynamicCache(config=model.config)
    layers = []
    for i in range(len(parts[0])):
        k0 = parts[0][i][0]
        used = sum(p[i][0].shape[0] * p[i][0].shape[2] for p in parts)
        keys = k0.new_empty((1, k0.shape[1], used + room, k0.shape[3]))
        values = k0.new_empty(keys.shape)
        at = 0
        for p in parts:
            k, v = p[i]
            rows, h, n, d = k.shape
            keys[0, :, at : at + rows * n].view(h, rows, n, d).copy_(k.transpose(0, 1))
            values[0, :, at : at + rows * n].view(h, rows, n, d).copy_(v.transpose(0, 1))
            at += rows * n
        layers.append(_Room(keys, values, used=used))
    cache.layers = layers
    return cache
