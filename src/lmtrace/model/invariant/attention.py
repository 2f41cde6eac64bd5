"""Attention that gives a query the same bits alone or among other queries, rows and paddings.

torch's kernels sum a query's scores and values in an order that depends on how many queries and
keys the call holds (sdpa: one query differs from its row in a causal prefill by 1.5e-7; MKL's
batched products move at fewer than 7 rows and with the key count). Here every query sees its
own keys, in order, from index 0 (a row's padding gathered out), cut into fixed chunks of CHUNK
keys:
- scores: (rows, head_dim) @ (head_dim, CHUNK) per chunk, with at least MIN_QUERIES rows (the
  products give a row the same bits at any row count from 7 up; fewer are padded);
- softmax over the chunks laid end to end, masked keys -inf: a key length that is a multiple of
  CHUNK gives the same sums with any number of masked chunks after it (measured);
- values: (rows, CHUNK) @ (CHUNK, head_dim) per chunk, the chunks' parts added one after another
  (a masked chunk adds exactly 0).
All of it is autograd's own operations, so gradients flow. Masks (layout.py): causal with any
padding, or offset by a cached beginning, computed a row at a time; anything else (prompts packed
into one row, a batch's decode step riding in their forward) a segment of queries at a time, each
segment as a row of its own: a query's bits depend only on its own keys, in order. A mask that
adds a bias, and a model whose attention has a window, sinks or a soft cap, are refused."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lmtrace.errors import InvalidParameter
from lmtrace.model.invariant.layout import Rows, layout

NAME = "lmtrace_batch_invariant"
CHUNK = 64  # keys per chunk of the scores and the values
MIN_QUERIES = 8  # query rows per product at least (MKL's small-row path sums in another order)


def invariant_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """sdpa's boolean mask, always built (never skipped for 'plain causal': the keys are counted from it)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _keys(t: torch.Tensor, index: torch.Tensor | None, padded: int) -> torch.Tensor:
    """`t` (batch, kv_heads, kv, d) gathered to the row's keys (None: all of them, in order) and
    zero-padded: (batch, kv_heads, padded, d)."""
    b, h, n, d = t.shape
    if index is not None:
        t, n = t.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d)), index.shape[1]
    return torch.nn.functional.pad(t, (0, 0, 0, padded - n))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: Rows, scale: float) -> torch.Tensor:
    """`query` (b, heads, q, d) against each row's keys (`key`/`value` (b, kv_heads, kv, d), gathered
    by `keys.index`; query i of row r sees the first `keys.lengths[r, i]`) -> (b, heads, q, d)."""
    b, heads, q, d = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    index, lengths = keys.index, keys.lengths
    chunks = -(-(kv if index is None else index.shape[1]) // CHUNK)
    padded = chunks * CHUNK
    k = _keys(key, index, padded).view(b, kv_heads, chunks, CHUNK, d)
    v = _keys(value, index, padded).view(b, kv_heads, chunks, CHUNK, d)
    groups = heads // kv_heads
    rows = groups * q  # a KV head's queries: its query heads' rows one after another
    pad = max(rows, MIN_QUERIES) - rows
    qq = torch.nn.functional.pad(query.reshape(b, kv_heads, rows, d), (0, 0, 0, pad))  # (b, kvh, rows', d)
    scores = torch.matmul(qq[:, :, None], k.transpose(-1, -2)) * scale  # (b, kvh, chunks, rows', CHUNK)
    scores = scores.permute(0, 1, 3, 2, 4).reshape(b, kv_heads, rows + pad, padded)
    # each query row's own key count (a padding query, which sees none, one: finite, never read)
    length = lengths.clamp(min=1).repeat(1, groups).view(b, 1, rows, 1)
    length = torch.nn.functional.pad(length, (0, 0, 0, pad), value=1)  # a padding row sees one key
    keep = torch.arange(padded, device=query.device) < length  # (b, 1, rows', padded)
    probs = torch.softmax(scores.float().masked_fill(~keep, float("-inf")), dim=-1).to(value.dtype)
    probs = probs.view(b, kv_heads, rows + pad, chunks, CHUNK).transpose(2, 3)  # (b, kvh, chunks, rows', CHUNK)
    parts = torch.matmul(probs, v)  # (b, kvh, chunks, rows', d)
    out = parts[:, :, 0]
    for c in range(1, chunks):  # chunk by chunk, in order: a masked chunk adds exactly 0
        out = out + parts[:, :, c]
    return out[:, :, :rows].reshape(b, heads, q, d)


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`t` (b, kv_heads, kv, d) at `rows` (S,): (S, kv_heads, kv, d), without a copy where b is 1."""
    return t.expand(rows.shape[0], -1, -1, -1) if t.shape[0] == 1 else t[rows]


def _segmented(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, found: list, scale: float) -> torch.Tensor:
    """Each segment (layout.Segment) attended as a row of its own -> (b, heads, q, d)."""
    out = torch.zeros_like(query)
    for seg in found:
        rows = seg.rows[:, None].expand_as(seg.queries)  # (S, m)
        q = query.transpose(1, 2)[rows, seg.queries].transpose(1, 2)  # (S, heads, m, d)
        k, v = _rows(key, seg.rows), _rows(value, seg.rows)
        done = attend(q, k, v, Rows(seg.index, seg.lengths), scale)
        out.transpose(1, 2)[rows, seg.queries] = done.transpose(1, 2)  # (S, m, heads, d) into (b, q, heads, d)
    return out


def invariant_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: `query` (b, heads, q, d), `key`/`value` (b, kv_heads, kv, d)
    -> ((b, q, heads, d), None)."""
    if kwargs.get("sliding_window") or kwargs.get("s_aux") is not None or getattr(module, "softcap", None):
        raise InvalidParameter("batch_invariant: this model's attention (a sliding window, sinks or a soft cap) "
                               "has no invariant kernel")  # fmt: skip
    b, _, q, d = query.shape
    kv = key.shape[2]
    if attention_mask is None:  # plain causal, queries at the end of the keys
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)[None, None]
        attention_mask = attention_mask.expand(b, 1, q, kv)
    found = layout(attention_mask, kv)
    scale = scaling if scaling is not None else d**-0.5
    if isinstance(found, Rows):
        out = attend(query, key, value, found, scale)
    else:
        out = _segmented(query, key, value, found, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, invariant_attention)
AttentionMaskInterface.register(NAME, invariant_mask)
