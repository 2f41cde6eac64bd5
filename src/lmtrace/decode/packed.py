"""Prompts that share a prefix cache, packed into one row: a forward without padding in which
prompts that begin alike compute their common beginning once (tree attention, as SGLang's
RadixAttention schedules it and Hydragen computes it).

One packed forward holds, as columns of a single row:

    [reused KV of the cached entries] [new tokens of prompt 1][new tokens of prompt 2]...

Each prompt has a context: for each of its positions, the column holding that token (an entry's
reused column, an earlier prompt's column for the beginning they share, or its own new column).
A 4D mask lets each new token attend its own context's columns up to its own position, and
position ids give each token its place in its own prompt, so every prompt's numbers are what
its own forward would give (within float noise). A prompt whose beginning another prompt of the
pack computes (its anchor) takes the anchor's numbers for the targets inside the shared part and
measures the target where they part from the anchor's distribution at the last shared token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmtrace.kv import ledger
from lmtrace.kv.prefix import Hit
from lmtrace.logits import measure


@dataclass
class Packed:
    """A prompt's place in a pack: its own cache hit, or an anchor (an earlier prompt of the
    pack) whose first `shared` tokens it shares."""

    ids: list[int]
    top_n: int | None
    hit: Hit | None = None
    anchor: int | None = None  # index in the pack
    shared: int = 0
    past: int = 0  # leading positions whose KV comes from the cache (this pack has no logits for them)
    columns: list[int] = field(default_factory=list)  # per position: its column in the packed row
    new: int = 0  # positions from here on are this prompt's own new columns

    @property
    def reuse(self) -> int:
        return self.hit.reuse if self.hit is not None else 0

    def __post_init__(self) -> None:
        self.past = self.reuse

def plan(rows: list[Packed]) -> tuple[list[Hit], list[int], list[int]]:
    """Columns of every prompt: the cache hits whose KV goes first (one block per entry, as
    long as its longest reuse), and the packed row's new token ids and positions. An anchor
    comes before the prompts that use it."""
    longest: dict[int, Hit] = {}  # id(entry) -> the hit reusing most of it
    for row in rows:
        if row.anchor is None and row.hit is not None:
            known = longest.get(id(row.hit.entry))
            if known is None or known.reuse < row.reuse:
                longest[id(row.hit.entry)] = row.hit
    starts, width = {}, 0
    for key, hit in longest.items():
        starts[key], width = width, width + hit.reuse
    ids: list[int] = []
    positions: list[int] = []
    for row in rows:
        if row.anchor is not None:
            row.columns = list(rows[row.anchor].columns[: row.shared])
        elif row.hit is not None:
            start = starts[id(row.hit.entry)]
            row.columns = list(range(start, start + row.reuse))
        else:
            row.columns = []
        row.new = len(row.columns)
        for p in range(row.new, len(row.ids)):
            row.columns.append(width + len(ids))
            ids.append(row.ids[p])
            positions.append(p)
    return list(longest.values()), ids, positions


def _mask(rows: list[Packed], width: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, new tokens, width + new tokens): 0 where a token attends, the dtype's minimum elsewhere."""
    allowed = torch.zeros((count, width + count), dtype=torch.bool)
    for row in rows:
        cols = torch.tensor(row.columns, dtype=torch.long)
        for p in range(row.new, len(row.ids)):
            allowed[cols[p] - width, cols[: p + 1]] = True
    mask = torch.zeros((count, width + count), dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def forward(model, rows: list[Packed]) -> list[tuple[torch.Tensor, measure.Forced | None, list]]:
    """Runs the pack; per prompt (its last distribution (vocab,) float32, its numbers for targets
    1..n-1 or None, its KV per layer (1, kv_heads, n, head_dim))."""
    blocks, ids, positions = plan(rows)
    width = sum(hit.reuse for hit in blocks)
    device, dtype = model.device, next(model.parameters()).dtype
    if blocks:
        parts = [hit.kv() for hit in blocks]  # per block, per layer (1, kv_heads, reuse, head_dim)
        layers = [(torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
                  for i in range(len(parts[0]))]  # fmt: skip
        cache = ledger.cache_of(model, layers)
    else:
        cache = ledger.new_cache(model)
    mask = _mask(rows, width, len(ids), dtype).to(device)
    out = model(
        input_ids=torch.tensor([ids], device=device),  # (1, new tokens)
        attention_mask=mask,
        position_ids=torch.tensor([positions], device=device),
        logits_to_keep=len(ids),
        **ledger.cache_kwargs(model, cache),
    )
    logits = out.logits[0]  # (new tokens, vocab)
    layers = ledger.layers_of(cache)  # (1, kv_heads, width + new tokens, head_dim)
    results: list[tuple[torch.Tensor, measure.Forced | None, list]] = []
    for row in rows:
        last = logits[row.columns[-1] - width].float().clone()
        numbers = _numbers(row, rows, results, logits, width) if row.top_n is not None else None
        spans = runs(row.columns)  # a few contiguous runs: copies of slices, no gather over the columns
        kv = [(torch.cat([k[:, :, a:b] for a, b in spans], dim=2), torch.cat([v[:, :, a:b] for a, b in spans], dim=2))
              for k, v in layers]  # fmt: skip
        results.append((last, numbers, kv))
    return results


def runs(columns: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, stop)]: the columns as maximal runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for c in columns:
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], c + 1)
        else:
            out.append((c, c + 1))
    return out


def _numbers(row: Packed, rows: list[Packed], done: list, logits: torch.Tensor, width: int) -> measure.Forced:
    """Targets 1..n-1: from the cache (up to its reuse), from the anchor (inside the shared
    part), the others measured from the packed row's logits at the position before each."""
    if row.anchor is not None:
        before = done[row.anchor][1]
        known = row.shared - 1  # targets 1..shared-1 lie inside the shared part
        numbers = measure.Forced(
            before.logprob[:known], before.rank[:known], before.entropy[:known],
            [t[: row.top_n] for t in before.top_ids[:known]], [t[: row.top_n] for t in before.top_logprobs[:known]],
        )  # fmt: skip
    elif row.hit is not None:
        numbers, known = row.hit.numbers(row.ids, row.top_n), min(row.reuse, len(row.ids) - 1)
    else:
        numbers, known = measure.Forced(), 0
    t = known + 1  # targets t.. are measured; position t - 1 predicts target t
    for a, b in runs([c - width for c in row.columns[known : len(row.ids) - 1]]):  # slices of the logits
        numbers.extend(measure.targets(logits[a:b], torch.tensor(row.ids[t : t + b - a]), row.top_n))
        t += b - a
    return numbers


def families(ids: Sequence[Sequence[int]], top_n: Sequence[int | None], reuse: Sequence[int], gain: int) -> list:
    """[(index, anchor index or None, shared)] in the order to pack: prompts side by side by
    their tokens, so that each shares the most with the one before it (a radix tree's order).
    A prompt takes its beginning from the one before (its anchor) where that gives it at least
    `gain` more tokens than the cache, the anchor's numbers serve it, and the anchor computes the
    last shared token in the pack (its distribution predicts where the two part)."""
    out: list[tuple[int, int | None, int]] = []
    past: dict[int, int] = {}  # leading positions a prompt takes from the cache, not the pack
    before = None
    for i in sorted(range(len(ids)), key=lambda i: list(ids[i])):
        out.append((i, None, 0))
        past[i] = reuse[i]
        if before is not None:
            shared = common(ids[before], ids[i])
            serves = top_n[i] is None or (top_n[before] is not None and top_n[before] >= top_n[i])
            if serves and shared - 1 >= reuse[i] + gain and shared - 1 >= past[before]:
                out[-1] = (i, before, shared)
                past[i] = min(shared, past[before])
        before = i
    return out


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of tokens two sequences share at their beginning."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
