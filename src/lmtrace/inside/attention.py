"""Attention over the KV cache at every step, captured without changing the numbers.

A registered attention function (transformers' AttentionInterface, with the matching mask
function) stands in for the model's own while a generation runs. Its output is the model's own
kernel's (sdpa, eager or the batch-invariant one), so the logits are unchanged bit for bit; beside it, the last query
row's weights are computed with eager attention's arithmetic (one query row: cheap at prefill
and at every one-query decode step). Only those weights are kept: averaged over heads, and per
head where asked (`heads=True`), and beside them the value-weighted weights (each weight times
the norm of that position's cached value vector, renormalised per head), which discount the
positions whose values carry little: an attention sink takes much weight and moves little.
Columns are key positions in the left-padded sequence; a sliding-window layer's cache holds
only the most recent keys, so its column j is position (total - kv_len + j)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from lmtrace.errors import InvalidParameter
from lmtrace.model.invariant import attention as invariant

SINKS = 4  # the first positions, where attention sinks form
RECENT = 32  # the most recent positions (the query's own included)
VALUED = ("top", "sink_mass", "entropy")  # the fields of a layer's `value_weighted` record
# the model's own implementation -> the capturing one registered for it
CAPTURE = {"sdpa": "lmtrace_sdpa", "eager": "lmtrace_eager", invariant.NAME: "lmtrace_invariant_capture"}
# each capturing implementation's kernel for the output (the model's own), by the model's implementation
KERNELS = {"sdpa": sdpa_attention_forward, invariant.NAME: invariant.invariant_attention}
MASKS = {"sdpa": sdpa_mask, "eager": eager_mask, invariant.NAME: invariant.invariant_mask}


def eager_weights(module: Any, query, key, value, mask, scaling: float | None, softcap: float | None):
    """eager_attention_forward's own arithmetic (Llama's, with Gemma-2's soft-capping):
    returns the output (batch, q, heads, dim) and the weights (batch, heads, q, kv)."""
    groups = getattr(module, "num_key_value_groups", 1)
    keys, values = repeat_kv(key, groups), repeat_kv(value, groups)
    if scaling is None:
        scaling = module.head_dim**-0.5
    weights = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:  # sdpa's boolean mask as eager's additive one
            mask = torch.where(mask, torch.tensor(0.0, dtype=weights.dtype), torch.finfo(weights.dtype).min)
        weights = weights + mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, values).transpose(1, 2).contiguous()
    return out, weights


def value_weighted(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Attention that discounts positions whose values carry little (Kobayashi et al. 2020,
    "Attention is not only a weight"): at head h, α_hj·‖v_j‖ renormalised over j, v_j the cached
    value vector of h's KV head, in float32. `weights` (batch, heads, kv_len), `value` (batch,
    kv_heads, kv_len, head_dim) -> (batch, heads, kv_len)."""
    norms = value.float().norm(dim=-1)  # (batch, kv_heads, kv_len)
    norms = norms.repeat_interleave(weights.shape[1] // norms.shape[1], dim=1)  # -> (batch, heads, kv_len)
    if weights.dim() == 4:  # (batch, heads, queries, kv_len): a verify forward's kept queries
        norms = norms[:, :, None, :]
    scaled = weights * norms
    return scaled / scaled.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def _forward(kind: str):
    def forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        softcap = kwargs.get("softcap")
        sink = getattr(module, "_lmtrace_attention", None)
        n = module._lmtrace_keep() if sink is not None else 1  # the last queries kept (a verify forward: several)
        if kind == "eager":  # the model's own arithmetic, weights included
            out, weights = eager_weights(module, query, key, value, attention_mask, scaling, softcap)
        else:  # the model's own kernel's output (the same logits, bit for bit); the last queries' weights aside
            out, _ = KERNELS[kind](
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
            weights = None
            if sink is not None:
                last = attention_mask[..., -n:, :] if attention_mask is not None else None
                if last is None and n > 1:  # plain causal: each kept query sees the keys up to its own
                    kv = key.shape[2]
                    last = torch.ones(n, kv, dtype=torch.bool, device=query.device).tril(kv - n)[None, None]
                _, weights = eager_weights(module, query[:, :, -n:], key, value, last, scaling, softcap)
        if sink is not None:
            kept = weights[:, :, -1, :].float() if n == 1 else weights[:, :, -n:, :].float()
            sink[module.layer_idx] = (kept, value_weighted(kept, value))  # (batch, heads, [n,] kv)
        return out, weights

    return forward


for _kind, _name in CAPTURE.items():
    AttentionInterface.register(_name, _forward(_kind))
    AttentionMaskInterface.register(_name, MASKS[_kind])


@contextmanager
def capturing(model, keep: Callable[[], int] = lambda: 1) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Switches the model to the capturing attention; yields the dict each forward fills with
    {layer index: (weights, value-weighted weights)} of the last query, each (batch, heads, kv_len);
    where `keep()` is more than one (a speculative block's verify forward), of the last `keep()`
    queries, each (batch, heads, keep, kv_len)."""
    original = model.config._attn_implementation
    if original not in CAPTURE:
        raise InvalidParameter(
            f"attention needs a model with sdpa, eager or batch-invariant attention, got {original!r}"
        )
    sink: dict[int, torch.Tensor] = {}
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")]
    model.set_attn_implementation(CAPTURE[original])
    for m in modules:
        m._lmtrace_attention, m._lmtrace_keep = sink, keep
    try:
        yield sink
    finally:
        for m in modules:
            del m._lmtrace_attention, m._lmtrace_keep
        model.set_attn_implementation(original)


def summarize(
    weights: dict[int, tuple[torch.Tensor, torch.Tensor]], total: int, pads: Sequence[int], top_n: int,
    heads: bool = False,
) -> list[list[dict]]:  # fmt: skip
    """Per row, per layer: {layer, top: [{position, weight}], sink_mass, recent_mass, entropy,
    value_weighted: {top, sink_mass, entropy}} over the mean of the heads, from `weights` {layer:
    (weights, value-weighted weights), each (batch, heads, kv_len)} over a left-padded sequence of
    `total` columns; with `heads`, also `heads: [{head, top, sink_mass, recent_mass, entropy}]`,
    each head's own. Positions are absolute (padding removed); padding never appears."""
    rows: list[list[dict]] = [[] for _ in pads]
    by_len: dict[int, list[int]] = {}
    for layer, (w, _) in weights.items():
        by_len.setdefault(w.shape[-1], []).append(layer)
    for layers in by_len.values():
        w = torch.stack([weights[i][0] for i in layers]).cpu()  # (layers, batch, heads, kv_len)
        vw = torch.stack([weights[i][1] for i in layers]).cpu()
        mean = _records(w.mean(2), total, pads, top_n)  # [layer][row]
        valued = _records(vw.mean(2), total, pads, top_n)
        per_head = None
        if heads:
            n = w.shape[2]  # every head of a row as a row of its own, with that row's padding
            flat = _records(w.flatten(1, 2), total, [p for p in pads for _ in range(n)], top_n)
            per_head = [[[{"head": h, **flat[li][r * n + h]} for h in range(n)] for r in range(len(pads))]
                        for li in range(len(layers))]  # fmt: skip
        for li, layer in enumerate(layers):
            for r in range(len(pads)):
                v = valued[li][r]
                record = {"layer": layer, **mean[li][r], "value_weighted": {k: v[k] for k in VALUED}}
                if per_head is not None:
                    record["heads"] = per_head[li][r]
                rows[r].append(record)
    for r in rows:
        r.sort(key=lambda d: d["layer"])
    return rows


def _records(w: torch.Tensor, total: int, pads: Sequence[int], top_n: int) -> list[list[dict]]:
    """[layer][row] {top, sink_mass, recent_mass, entropy} from `w` (layers, rows, kv_len), the
    rows' columns the last kv_len of a sequence of `total` columns left-padded by `pads`."""
    kv_len = w.shape[-1]
    pad = torch.tensor(list(pads))[:, None]  # (rows, 1)
    pos = torch.arange(total - kv_len, total)[None, :] - pad  # (rows, kv_len) absolute positions
    valid = pos >= 0
    w = w.masked_fill(~valid, 0.0)
    query = total - 1 - pad  # (rows, 1) the query's own position
    sink = (w * (valid & (pos < SINKS))).sum(-1)
    recent = (w * (pos > query - RECENT)).sum(-1)
    entropy = -torch.special.xlogy(w, w).sum(-1)
    top_w, top_i = w.masked_fill(~valid, -1.0).topk(min(top_n, kv_len), dim=-1)
    top_pos = pos.expand_as(w).gather(-1, top_i)
    out = []
    for sinks, recents, ents, tws, tps in zip(sink.tolist(), recent.tolist(), entropy.tolist(), top_w.tolist(),
                                              top_pos.tolist()):  # fmt: skip
        # masked columns (outside a sliding window, padding) have weight 0: never listed
        out.append([{"top": [{"position": p, "weight": x} for p, x in zip(tps[r], tws[r]) if p >= 0 and x > 0],
                     "sink_mass": sinks[r], "recent_mass": recents[r], "entropy": ents[r]}
                    for r in range(len(pads))])  # fmt: skip
    return out
