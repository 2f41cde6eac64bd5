"""A row's own part of a left-padded batch's KV cache.

A batch's cache holds every row, each left-padded to the longest prompt. A row's part is the
positions that hold its own tokens: exactly the tensors it would hold decoded alone. Batch jobs
record that part, so that a line's trace does not depend on which lines shared its batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _layer_part(entry: dict[str, Any], rows: int, own_seen: int) -> dict[str, Any]:
    keys = entry.get("keys")
    if not keys:  # a layer without a cache
        return dict(entry)
    held = keys[2]  # (batch, kv_heads, held, head_dim)
    # a full layer holds the row's tokens and its padding; a sliding one at most window - 1
    own_held = min(held, own_seen)
    per_position = entry["bytes"] // (rows * held)
    used_per_position = entry["bytes_used"] // (rows * held)
    shape = [1, keys[1], own_held, keys[3]]
    return {
        **entry,
        "keys": shape,
        "values": [1, entry["values"][1], own_held, entry["values"][3]] if entry.get("values") else None,
        "bytes": per_position * own_held,
        "bytes_used": used_per_position * own_held,
    }


def own_part(kv: dict[str, Any], pad: int, rows: int, expected: Callable[[int], int] | None = None) -> dict[str, Any]:
    """The cache record of one row of a `rows`-row batch, padded on the left by `pad` positions:
    its seq_len, bytes and per-layer shapes as if it had been decoded alone (batch 1).
    `expected(seq_len) -> bytes` is the formula for one row, as the engine checks it."""
    own_seen = kv["seq_len"] - pad
    if rows == 1 and pad == 0:
        return kv
    if not kv.get("layers"):  # bytes per row need each layer's shape (a sliding layer holds fewer)
        raise ValueError("own_part needs the per-layer detail of the cache record")
    parts: dict[tuple, dict[str, Any]] = {}  # layers alike (every full layer of a model) computed once
    layers = []
    for e in kv["layers"]:
        alike = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in e.items() if k != "layer")
        if alike not in parts:
            parts[alike] = _layer_part(e, rows, own_seen)
        layers.append({**parts[alike], "layer": e["layer"]} if "layer" in e else dict(parts[alike]))
    out: dict[str, Any] = {"seq_len": own_seen, "bytes": sum(e["bytes"] for e in layers)}
    if expected is not None:
        out["expected_bytes"] = expected(own_seen)
    out["layers"] = layers
    return out
