"""Which keys each query of an attention mask sees, in order: what the invariant attention
(attention.py) needs to give a query the same bits however the forward around it is laid out.

A query's numbers depend only on its own keys, in column order (its 'key list'). Two layouts:
- `Rows`: every query's key list is a prefix of its row's key list (causal with any padding; a
  prompt after its cached beginning, whose queries attend the cached columns first: a causal
  mask offset by the cached length). One gather per row, all of a row's queries together.
- `Segment`s: anything else (prompts packed into one row, each attending its own columns; a
  running batch's decode step riding in that forward; a window). Consecutive queries whose key
  lists are prefixes of one list form a segment, computed as a row of its own; segments with the
  same number of queries go together.
A float mask (lmtrace's packed forwards hand one over) counts 0 as seen and its minimum (or -inf)
as hidden; a bias of any other value is refused in one line."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmtrace.errors import InvalidParameter


@dataclass
class Rows:
    """Each row's keys in order: `index` (batch, n) of the columns (None: every column, in
    order), `lengths` (batch, q) each query's count (its keys are the first ones)."""

    index: torch.Tensor | None
    lengths: torch.Tensor


@dataclass
class Segment:
    """Segments of `m` queries each, computed as rows of their own: `rows` (S,) the batch row,
    `queries` (S, m) the query positions, `index` (S, n) the key columns in order (padded past a
    segment's own with column 0, never seen), `lengths` (S, m) each query's key count."""

    rows: torch.Tensor
    queries: torch.Tensor
    index: torch.Tensor
    lengths: torch.Tensor


def seen(mask: torch.Tensor, kv: int) -> torch.Tensor:
    """(batch, q, kv) bool from a 4D mask (batch, 1, q, >= kv): True where a query sees a key."""
    m = mask[:, 0, :, -kv:]
    if m.dtype == torch.bool:
        return m
    hidden = m <= torch.finfo(m.dtype).min / 2  # the dtype's minimum, or -inf
    if not bool(((m == 0) | hidden).all()):
        raise InvalidParameter(
            "batch_invariant: this attention mask adds a bias (a value neither 0 nor -inf), "
            "which the invariant attention does not compute"
        )
    return m == 0


def rows(allowed: torch.Tensor) -> Rows | None:
    """The `Rows` layout of `allowed` (batch, q, kv), None where a query's keys are not a prefix
    of its row's keys."""
    kv = allowed.shape[-1]
    any_query = allowed.any(dim=1)  # (batch, kv): the keys any query of the row sees
    n = int(any_query.sum(-1).max())
    index = torch.argsort((~any_query).to(torch.int8), dim=-1, stable=True)[:, :n]  # (batch, n)
    lengths = allowed.sum(-1)  # (batch, q)
    gathered = allowed.gather(-1, index[:, None, :].expand(-1, allowed.shape[1], -1))  # (batch, q, n)
    if not torch.equal(gathered, torch.arange(n, device=allowed.device) < lengths[..., None]):
        return None
    if n == kv and torch.equal(index, torch.arange(kv, device=index.device).expand_as(index)):
        index = None  # no padding: nothing to gather
    return Rows(index, lengths)


def _lists(allowed: np.ndarray) -> list[tuple[int, list[int], np.ndarray]]:
    """[(row, its queries, the longest key list)]: runs of consecutive queries whose key lists
    are prefixes of one list (a query that sees nothing goes with the run before it)."""
    out: list[tuple[int, list[int], np.ndarray]] = []
    for b in range(allowed.shape[0]):
        start = len(out)
        for i in range(allowed.shape[1]):
            keys = np.flatnonzero(allowed[b, i])
            if len(out) > start:
                _, queries, longest = out[-1]
                n = min(len(keys), len(longest))
                if np.array_equal(keys[:n], longest[:n]):
                    queries.append(i)
                    if len(keys) > len(longest):
                        out[-1] = (b, queries, keys)
                    continue
            out.append((b, [i], keys))
    return out


def segments(allowed: torch.Tensor) -> list[Segment]:
    """The `Segment` layout of `allowed` (batch, q, kv), grouped by the number of queries."""
    counts = allowed.sum(-1).cpu().numpy()  # (batch, q)
    by_size: dict[int, list[tuple[int, list[int], np.ndarray]]] = {}
    for b, queries, keys in _lists(allowed.cpu().numpy()):
        by_size.setdefault(len(queries), []).append((b, queries, keys))
    out = []
    device = allowed.device
    for m, group in by_size.items():
        n = max(max(len(keys) for _, _, keys in group), 1)
        index = np.zeros((len(group), n), dtype=np.int64)
        for s, (_, _, keys) in enumerate(group):
            index[s, : len(keys)] = keys
        queries = np.array([q for _, q, _ in group], dtype=np.int64).reshape(len(group), m)
        lengths = counts[np.array([b for b, _, _ in group])[:, None], queries]  # (S, m)
        where = torch.tensor([b for b, _, _ in group], device=device)
        tensors = (torch.from_numpy(a).to(device) for a in (queries, index, lengths))
        out.append(Segment(where, *tensors))
    return out


# the last mask's layout: every layer of a forward is handed the same mask tensor, so it is
# computed once a forward (the memo holds that one mask: it is the tensor itself that is compared)
_memo: list = []


def layout(mask: torch.Tensor, kv: int) -> Rows | list[Segment]:
    """The layout of a 4D mask (batch, 1, q, >= kv) over the last `kv` keys, once per mask tensor."""
    if _memo and _memo[0] is mask and _memo[1] == kv:
        return _memo[2]
    allowed = seen(mask, kv)
    found = rows(allowed)
    result = found if found is not None else segments(allowed)
    _memo[:] = [mask, kv, result]
    return result
