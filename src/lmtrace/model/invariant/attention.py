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
All of it is autograd's own operations, so gradients flow. Masks: causal with any padding (each
query's keys a prefix of its row's keys); anything else is refused rather than run variant."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lmtrace.errors import InvalidParameter

NAME = "lmtrace_batch_invariant"
CHUNK = 64  # keys per chunk of the scores and the values
MIN_QUERIES = 8  # query rows per product at least (MKL's small-row path sums in another order)


def invariant_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """sdpa's boolean mask, always built (never skipped for 'plain causal': the keys are counted from it)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _compact(mask: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index (batch, keys) of each row's keys in order, lengths (batch, q) of each query's prefix)
    from the boolean `mask` (batch, 1, q, kv); refuses a mask whose keys are not prefixes."""
    allowed = mask[:, 0, :, -kv:]  # (batch, q, kv)
    seen = allowed.any(dim=1)  # (batch, kv): the keys any query of the row sees
    n = int(seen.sum(-1).max())
    index = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True)[:, :n]  # (batch, n)
    lengths = allowed.sum(-1)  # (batch, q)
    gathered = allowed.gather(-1, index[:, None, :].expand(-1, allowed.shape[1], -1))  # (batch, q, n)
    prefix = torch.arange(n, device=mask.device) < lengths[..., None]
    if not torch.equal(gathered, prefix):
        raise InvalidParameter("batch_invariant: this attention mask (packed sequences or a window) is not "
                               "causal with padding, which the invariant attention computes")  # fmt: skip
    return index, lengths


# the last mask's compact form: every layer of a forward is handed the same mask tensor, so it is
# computed once a forward (the memo holds that one mask: it is the tensor itself that is compared)
_memo: list = []


def _compacted(mask: torch.Tensor, kv: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`_compact` once per mask tensor; the index None where every row's keys are all the keys in
    order (no padding: nothing to gather)."""
    if _memo and _memo[0] is mask and _memo[1] == kv:
        return _memo[2], _memo[3]
    index, lengths = _compact(mask, kv)
    if index.shape[1] == kv and torch.equal(index, torch.arange(kv, device=index.device).expand_as(index)):
        index = None
    _memo[:] = [mask, kv, index, lengths]
    return index, lengths


def _keys(t: torch.Tensor, index: torch.Tensor | None, padded: int) -> torch.Tensor:
    """`t` (batch, kv_heads, kv, d) gathered to the row's keys (None: all of them, in order) and
    zero-padded: (batch, kv_heads, padded, d)."""
    b, h, n, d = t.shape
    if index is not None:
        t, n = t.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d)), index.shape[1]
    return torch.nn.functional.pad(t, (0, 0, 0, padded - n))


def invariant_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: `query` (b, heads, q, d), `key`/`value` (b, kv_heads, kv, d)
    -> ((b, q, heads, d), None)."""
    if kwargs.get("sliding_window") or kwargs.get("s_aux") is not None or getattr(module, "softcap", None):
        raise InvalidParameter("batch_invariant: this model's attention (a sliding window, sinks or a soft cap) "
                               "has no invariant kernel")  # fmt: skip
    b, heads, q, d = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    if attention_mask is None:  # plain causal, queries at the end of the keys
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)[None, None]
        attention_mask = attention_mask.expand(b, 1, q, kv)
    index, lengths = _compacted(attention_mask, kv)
    chunks = -(-(kv if index is None else index.shape[1]) // CHUNK)
    padded = chunks * CHUNK
    k = _keys(key, index, padded).view(b, kv_heads, chunks, CHUNK, d)
    v = _keys(value, index, padded).view(b, kv_heads, chunks, CHUNK, d)
    groups = heads // kv_heads
    rows = groups * q  # a KV head's queries: its query heads' rows one after another
    pad = max(rows, MIN_QUERIES) - rows
    qq = torch.nn.functional.pad(query.reshape(b, kv_heads, rows, d), (0, 0, 0, pad))  # (b, kvh, rows', d)
    scale = scaling if scaling is not None else d**-0.5
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
    out = out[:, :, :rows].reshape(b, heads, q, d)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, invariant_attention)
AttentionMaskInterface.register(NAME, invariant_mask)
