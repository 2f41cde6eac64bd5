"""Prompts that share a prefix cache, laid side by side in one row: a forward without padding in which
prompts that begin alike compute their common beginning once (tree attention, as SGLang's
RadixAttention schedules it and Hydragen computes it).

One tree forward holds, as columns of a single row:

    [reused KV of the cached entries] [new tokens of prompt 1][new tokens of prompt 2]...

Each prompt has a context: for each of its positions, the column holding that token (an entry's
reused column, an earlier prompt's column for the beginning they share, or its own new column).
A 4D mask lets each new token attend its own context's columns up to its own position, and
position ids give each token its place in its own prompt, so every prompt's numbers are what
its own forward would give (within float noise). A prompt whose beginning another prompt of the
pack computes (its anchor) takes the anchor's numbers for the targets inside the shared part and
measures the target where they part from the anchor's distribution at the last shared token.

A running batch's next decode step may ride in a pack (Ride): its rows' caches go in as more
columns, its new tokens as more queries (each attends its own row's columns), so that one forward
reads the weights once for the batch's step and the prompts that join it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmtrace.kv import ledger
from lmtrace.kv.prefix import Hit
from lmtrace.logits import measure


@dataclass
class TreePrompt:
    """A prompt's place in a pack: its own cache hit, or an anchor (an earlier prompt of the
    pack) whose first `shared` tokens it shares."""

    ids: list[int]
    top_n: int | None
    hit: Hit | None = None
    anchor: int | None = None  # index in the pack
    shared: int = 0
    past: int = 0  # leading positions whose KV comes from the cache (this pack has no logits for them)
    columns: list[int] = field(default_factory=list)  # per position: its column in the tree row
    new: int = 0  # positions from here on are this prompt's own new columns

    @property
    def reuse(self) -> int:
        return self.hit.reuse if self.hit is not None else 0

    def __post_init__(self) -> None:
        self.past = self.reuse


@dataclass
class Ride:
    """A running batch's next decode step, computed in a pack's forward. The batch's cache
    (per layer (B, kv_heads, W, head_dim), left-padded) follows the pack's cache hits as B x W
    columns, and its new tokens are the forward's first B queries, each attending its own row's
    columns. After the forward: `logits` (B, vocab) float32, and `new` per layer the new tokens'
    KV (B, kv_heads, 1, head_dim) for the batch to append."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor  # (B, W): 1 on each row's own columns
    tokens: torch.Tensor  # (B,): each row's new token
    positions: torch.Tensor  # (B,): its position in its own sequence
    logits: torch.Tensor | None = None
    new: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def columns(self) -> int:
        return int(self.mask.numel())

    def allow(self, allowed: torch.Tensor, start: int, past: int) -> None:
        """Row b's query (b) attends its own columns (from `start`) and its new token's column."""
        b, w = self.mask.shape
        own = allowed[:b, start : start + b * w].view(b, b, w)
        own[torch.arange(b), torch.arange(b)] = self.mask.bool().cpu()
        allowed[torch.arange(b), past + torch.arange(b)] = True

    def took(self, logits: torch.Tensor, layers: list, past: int) -> None:
        """The step's results from the forward: logits (B, vocab) and the new tokens' KV."""
        b = self.rows

        def new(t: torch.Tensor) -> torch.Tensor:  # (1, h, columns, d) -> (B, h, 1, d)
            return t[0, :, past : past + b].transpose(0, 1).unsqueeze(2)

        self.logits = logits.float()
        self.new = [(new(k), new(v)) for k, v in layers]


def plan(rows: list[TreePrompt], before: int = 0) -> tuple[list[Hit], list[int], list[int]]:
    """Columns of every prompt: the cache hits whose KV goes first (one block per entry, as
    long as its longest reuse), and the tree row's new token ids and positions. An anchor
    comes before the prompts that use it. `before`: columns between the hits and the prompts'
    new tokens (a riding batch's cache and new tokens)."""
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
            row.columns.append(width + before + len(ids))
            ids.append(row.ids[p])
            positions.append(p)
    return list(longest.values()), ids, positions


def _mask(
    rows: list[TreePrompt], past: int, count: int, dtype: torch.dtype, ride: Ride | None, width: int
) -> torch.Tensor:
    """(1, 1, queries, past + queries): 0 where a query attends, the dtype's minimum elsewhere.
    The first `past` columns are cached ones (hits, then a riding batch's from `width`)."""
    allowed = torch.zeros((count, past + count), dtype=torch.bool)
    if ride is not None:
        ride.allow(allowed, width, past)
    for row in rows:
        cols = torch.tensor(row.columns, dtype=torch.long)
        for p in range(row.new, len(row.ids)):
            allowed[cols[p] - past, cols[: p + 1]] = True
    mask = torch.zeros((count, past + count), dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


Result = tuple[torch.Tensor, "measure.Forced | None", list]  # last distribution, numbers, KV


def forward(model, rows: list[TreePrompt], ride: Ride | None = None) -> list[Result]:
    """Runs the pack (and the riding batch's step, its results set on `ride`); per prompt (its
    last distribution (vocab,) float32, its numbers for targets 1..n-1 or None, its KV per layer
    (1, kv_heads, n, head_dim))."""
    riders = ride.rows if ride is not None else 0
    blocks, ids, positions = plan(rows, ride.columns + riders if ride is not None else 0)
    width = sum(hit.reuse for hit in blocks)
    past = width + (ride.columns if ride is not None else 0)  # columns before the first query
    device, dtype = model.device, next(model.parameters()).dtype
    parts = [hit.kv() for hit in blocks]  # per part, per layer (1, kv_heads, len, head_dim)
    parts += [ride.layers] if ride is not None else []  # (B, kv_heads, W, head_dim): its rows one after another
    count = len(ids) + riders
    cache = ledger.cache_with_room(model, parts, count) if parts else ledger.new_cache(model)
    if ride is not None:
        ids, positions = ride.tokens.tolist() + ids, ride.positions.tolist() + positions
    mask = _mask(rows, past, len(ids), dtype, ride, width).to(device)
    keep, at = _kept(rows, past, riders, len(ids))
    out = model(
        input_ids=torch.tensor([ids], device=device),  # (1, queries)
        attention_mask=mask,
        position_ids=torch.tensor([positions], device=device),
        logits_to_keep=keep if isinstance(keep, int) else keep.to(device),
        **ledger.cache_kwargs(model, cache),
    )
    logits = out.logits[0]  # (kept queries, vocab)
    layers = ledger.layers_of(cache)  # (1, kv_heads, past + queries, head_dim)
    if ride is not None:
        ride.took(logits[:riders], layers, past)
    results: list[Result] = []
    for row in rows:
        last = logits[at(row.columns[-1] - past)].float().clone()
        numbers = _numbers(row, rows, results, logits, past) if row.top_n is not None else None
        spans = runs(row.columns)  # a few contiguous runs: copies of slices, no gather over the columns
        kv = [(torch.cat([k[:, :, a:b] for a, b in spans], dim=2), torch.cat([v[:, :, a:b] for a, b in spans], dim=2))
              for k, v in layers]  # fmt: skip
        results.append((last, numbers, kv))
    return results


def _kept(rows: list[TreePrompt], past: int, riders: int, count: int):
    """The queries whose logits the forward computes (all of them when a prompt is measured;
    else the riders' and each prompt's last), and a query's row among them."""
    if any(row.top_n is not None for row in rows):
        return count, lambda q: q
    wanted = sorted(set(range(riders)) | {row.columns[-1] - past for row in rows})
    where = {q: i for i, q in enumerate(wanted)}
    return torch.tensor(wanted, dtype=torch.long), where.__getitem__


def runs(columns: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, stop)]: the columns as maximal runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for c in columns:
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], c + 1)
        else:
            out.append((c, c + 1))
    return out


def _numbers(row: TreePrompt, rows: list[TreePrompt], done: list, logits: torch.Tensor, past: int) -> measure.Forced:
    """Targets 1..n-1: from the cache (up to its reuse), from the anchor (inside the shared
    part), the others measured from the tree row's logits at the position before each."""
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
    for a, b in runs([c - past for c in row.columns[known : len(row.ids) - 1]]):  # slices of the logits
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
    return len(os.path.commonprefix([list(a), list(b)]))
