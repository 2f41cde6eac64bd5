"""Many prompts prefilled together: the one batched teacher-forced path. A list of texts scored
(lmtrace.score), the server's echo and scoring requests, and the server's generations before they
join the running batch all run it.

Rows that do not share a prefix cache go in padded forwards grouped by length, each prompt
right-aligned so that its last token sits in the last column:

    row i:  [pad W - n_i][its n_i tokens]

(a row alone is exactly engine.prefill's forward: no mask, positions 0..n-1, the same numbers
to the bit). Rows that share the cache (lmtrace.kv.prefix) go in tree forwards
(lmtrace.decode.tree_prefill): no padding, each prompt from its longest cached beginning or from the
beginning another prompt of its pack computes, and kept in the cache afterwards. A running
batch's next decode step may ride in the first forward (`ride`, lmtrace.decode.tree_prefill.Ride): the
prompts joining the batch then cost no forward of their own."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmtrace.decode import tree_prefill
from lmtrace.kv import ledger
from lmtrace.kv.prefix import KV, Hit, PrefixCache
from lmtrace.logits import measure

ROWS = 16  # rows per padded forward
TOKENS = 1024  # padded tokens per forward: bounds the (rows, width, vocab) float logits
TREE_TOKENS = 512  # new tokens per tree forward: its attention is (tokens x columns) per head
MIN_GAIN = 8  # tokens a row must share with an earlier row of its pack, beyond its cache hit, to take them
# padded tokens a forward may waste before a longer row starts a forward of its own: about what
# a forward's fixed cost (reading every weight once) is worth in tokens on a CPU
SPLIT_TOKENS = 32


@dataclass
class PromptRow:
    """A prompt to prefill. `top_n`: measure its tokens teacher-forced (logprob, rank, entropy,
    `top_n` alternatives) from target `first` on; None: only the distribution after it.
    `share`: reuse the prefix cache and be kept in it (a row that does not share is computed
    as before any cache: alone, it is engine.prefill's forward to the bit)."""

    ids: list[int]
    top_n: int | None = None
    first: int = 1
    share: bool = True


@dataclass
class Prefilled:
    """A prefilled prompt: the distribution after it, its numbers, its KV."""

    ids: list[int]
    logits: torch.Tensor  # (vocab,) float32: the distribution of the token after the prompt
    numbers: measure.Forced | None  # targets max(first, 1)..n-1, as measure.targets gives them
    kv: KV | None  # per layer (1, kv_heads, n, head_dim), None unless kept
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    ms: float = 0.0  # this row's share of its forward's time


def prefill_many(
    model,
    rows: Sequence[PromptRow],
    *,
    pad_id: int,
    cache: PrefixCache | None = None,
    keep_kv: bool = False,
    max_rows: int = ROWS,
    max_tokens: int = TOKENS,
    ride: tree_prefill.Ride | None = None,
) -> list[Prefilled]:
    """Prefills every row, in order; with a `cache`, each row that shares reuses its longest
    cached beginning and is kept in the cache afterwards. `keep_kv`: every result carries its KV.
    `ride`: a batch's decode step computed in the first forward (its results set on it)."""
    if cache is not None:
        cache.check_weights(model)
    out: list[Prefilled | None] = [None] * len(rows)
    sharing = [i for i, r in enumerate(rows) if cache is not None and r.share]
    alone = [i for i, r in enumerate(rows) if cache is None or not r.share]
    with torch.inference_mode():
        if ride is not None and alone:
            alone = _ridden(model, rows, alone, ride, keep_kv, out)
            ride = None
        sizes = {i: len(rows[i].ids) for i in alone}
        for group in groups(alone, sizes, [rows[i].top_n is not None for i in alone], max_rows, max_tokens):
            for i, p in zip(group, _forward(model, [rows[i] for i in group], pad_id, keep_kv)):
                out[i] = p
        if sharing:
            _shared(model, rows, sharing, cache, out, (pad_id, max_rows, min(max_tokens, TREE_TOKENS)), ride)
    return out  # type: ignore[return-value]


def _ridden(
    model, rows: Sequence[PromptRow], indices: list[int], ride: tree_prefill.Ride, keep: bool, out: list
) -> list:
    """Rows that share nothing, in one tree forward with the riding batch's step (at most
    TREE_TOKENS new tokens, at least one row); returns the rows left for padded forwards."""
    taken, tokens = [], 0
    for i in indices:
        if taken and tokens + len(rows[i].ids) > TREE_TOKENS:
            break
        taken.append(i)
        tokens += len(rows[i].ids)
    started = time.perf_counter()
    results = tree_prefill.forward(
        model, [tree_prefill.TreePrompt(list(rows[i].ids), rows[i].top_n) for i in taken], ride
    )
    ms = (time.perf_counter() - started) * 1000 / len(taken)
    for i, (last, numbers, kv) in zip(taken, results):
        if numbers is not None and rows[i].first > 1:
            numbers = _after(numbers, rows[i].first)
        out[i] = Prefilled(list(rows[i].ids), last, numbers, kv if keep else None, 0, ms)
    return indices[len(taken) :]


def _shared(
    model,
    rows: Sequence[PromptRow],
    indices: list[int],
    cache: PrefixCache,
    out: list,
    limits: tuple,
    ride: tree_prefill.Ride | None = None,
) -> None:
    """Rows that share the cache, in tree forwards of at most `limits[2]` new tokens: each
    from its longest cached beginning, or from the beginning an earlier row of its pack computes."""
    budget = limits[2]
    planned = [cache.lookup(rows[i].ids, rows[i].top_n, count=False) for i in indices]
    reuse = [h.reuse if h is not None else 0 for h in planned]
    order = tree_prefill.families([rows[i].ids for i in indices], [rows[i].top_n for i in indices], reuse, MIN_GAIN)
    packs: list[list[tuple[int, int | None, int]]] = [[]]
    tokens = 0
    for k, anchor, shared in order:
        new = len(rows[indices[k]].ids) - (shared if anchor is not None else reuse[k])
        if packs[-1] and tokens + new > budget:
            packs.append([])
            tokens = 0
        lead = indices[anchor] if anchor is not None else None
        if lead is not None and all(i != lead for i, _, _ in packs[-1]):
            lead = None  # its anchor went in an earlier pack: it finds that one in the cache
        packs[-1].append((indices[k], lead, shared))
        tokens += new
    for pack in packs:
        if _run_pack(model, rows, pack, cache, out, limits, ride):
            ride = None


def _run_pack(
    model,
    rows: Sequence[PromptRow],
    pack: list,
    cache: PrefixCache,
    out: list,
    limits: tuple,
    ride: tree_prefill.Ride | None = None,
) -> bool:
    """One tree forward (the riding step's too); each row kept in the cache after it (the
    next pack reuses them). A pack in which nothing is shared goes in padded forwards instead
    (no attention across the whole pack to pay for), unless a step rides. True when it rode."""
    started = time.perf_counter()
    members: list[tree_prefill.TreePrompt] = []
    where: dict[int, int] = {}  # row index -> place in the pack
    for i, anchor, shared in pack:
        row = rows[i]
        hit = cache.lookup(row.ids, row.top_n, count=False)
        reuse = hit.reuse if hit is not None else 0
        if hit is not None and reuse == len(row.ids):
            out[i] = _from_cache(row, hit)  # asked before: no forward at all
            cache.count(len(row.ids), reuse)
            continue
        lead = members[where[anchor]] if anchor in where else None
        if lead is not None and shared - 1 >= max(reuse, lead.past):
            member = tree_prefill.TreePrompt(list(row.ids), row.top_n, anchor=where[anchor], shared=shared)
            member.past = min(shared, lead.past)
        else:
            member = tree_prefill.TreePrompt(list(row.ids), row.top_n, hit=hit)
        where[i] = len(members)
        members.append(member)
    if not members:
        return False
    if ride is None and all(m.hit is None and m.anchor is None for m in members):
        _unshared(model, rows, list(where), cache, out, limits)
        return False
    results = tree_prefill.forward(model, members, ride)
    ms = (time.perf_counter() - started) * 1000 / len(members)
    for i, member, (last, numbers, kv) in zip(where, members, results):
        saved = member.shared if member.anchor is not None else member.reuse
        cache.count(len(member.ids), saved)
        whole = numbers if rows[i].first <= 1 else None  # a partial record is not kept
        cache.insert(member.ids, kv, whole, rows[i].top_n or 0, last)
        if numbers is not None and rows[i].first > 1:
            numbers = _after(numbers, rows[i].first)
        out[i] = Prefilled(member.ids, last, numbers, kv, saved, ms)
    return ride is not None


def _unshared(model, rows: Sequence[PromptRow], indices: list[int], cache: PrefixCache, out: list, limits) -> None:
    pad_id, max_rows, max_tokens = limits
    sizes = {i: len(rows[i].ids) for i in indices}
    for group in groups(indices, sizes, [rows[i].top_n is not None for i in indices], max_rows, max_tokens):
        for i, p in zip(group, _forward(model, [rows[i] for i in group], pad_id, True)):
            cache.count(len(p.ids), 0)
            cache.insert(p.ids, p.kv, p.numbers if rows[i].first <= 1 else None, rows[i].top_n or 0, p.logits)
            out[i] = p


def _after(numbers: measure.Forced, first: int) -> measure.Forced:
    """Targets first..n-1 of numbers that hold targets 1..n-1."""
    a = first - 1
    n = numbers
    return measure.Forced(n.logprob[a:], n.rank[a:], n.entropy[a:], n.top_ids[a:], n.top_logprobs[a:])


def _from_cache(row: PromptRow, hit: Hit) -> Prefilled:
    """A prompt that is a cached one: its numbers, distribution and KV as they were computed."""
    numbers = hit.numbers(row.ids, row.top_n, max(row.first, 1)) if row.top_n is not None else None
    return Prefilled(list(row.ids), hit.entry.last.clone(), numbers, hit.entry.kv, hit.reuse)


def groups(
    indices: Sequence[int], sizes: dict[int, int], measured: Sequence[bool], max_rows: int, max_tokens: int
) -> list[list[int]]:
    """The rows in forwards: those measured apart from the others (they keep every position's
    logits), shortest first, at most `max_rows` rows and `max_tokens` padded tokens each (a
    longer row goes alone), and a longer row starts a new forward where padding the ones before
    it to its length would waste more than SPLIT_TOKENS tokens."""
    flag = dict(zip(indices, measured))
    out: list[list[int]] = []
    for i in sorted(indices, key=lambda i: (flag[i], sizes[i])):
        last = out[-1] if out else None
        fits = last and flag[last[0]] == flag[i] and len(last) < max_rows and (len(last) + 1) * sizes[i] <= max_tokens
        if fits and len(last) * (sizes[i] - sizes[last[-1]]) <= SPLIT_TOKENS:
            last.append(i)
        else:
            out.append([i])
    return out


def _layout(rows: Sequence[PromptRow], pad_id: int, device) -> tuple:
    """Input ids (k, W) right-aligned, attention mask (k, W) or None when nothing is padded,
    position ids (k, W)."""
    w = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), w), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), w), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, w - len(row.ids) :] = torch.tensor(row.ids, dtype=torch.long)
        mask[i, w - len(row.ids) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = bool((mask == 0).any())
    return ids.to(device), (mask.to(device) if padded else None), pos.to(device)


def stack_left(parts: Sequence[KV | None], width: int) -> KV:
    """Rows' KV (per layer (1, kv_heads, len, head_dim); None: no tokens) left-padded with
    zeros to `width` and stacked: per layer (rows, kv_heads, width, head_dim)."""
    template = next(p for p in parts if p is not None)
    layers = []
    for layer, (k0, v0) in enumerate(template):
        keys, values = [], []
        for part in parts:
            k, v = part[layer] if part is not None else (k0[:, :, :0], v0[:, :, :0])
            pad = width - k.shape[2]
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))  # (1, h, len, d) -> (1, h, width, d)
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        layers.append((torch.cat(keys), torch.cat(values)))
    return layers


def _forward(model, rows: Sequence[PromptRow], pad_id: int, keep: bool) -> list[Prefilled]:
    """One padded forward of rows that share nothing."""
    started = time.perf_counter()
    ids, mask, pos = _layout(rows, pad_id, model.device)
    w = ids.shape[1]
    cache = ledger.new_cache(model) if keep else None
    measured = any(r.top_n is not None for r in rows)
    kwargs = ledger.cache_kwargs(model, cache) if cache is not None else {"use_cache": False}
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=w if measured else 1, **kwargs)
    logits = out.logits  # (k, w or 1, vocab)
    layers = ledger.layers_of(cache) if keep else None
    results = []
    for i, row in enumerate(rows):
        n = len(row.ids)
        numbers = None
        if row.top_n is not None:
            t = max(row.first, 1)  # the first target; position t - 1 predicts it
            numbers = measure.targets(logits[i, w - 1 - (n - t) : w - 1], torch.tensor(row.ids[t:]), row.top_n)
        kv = None
        if layers is not None:  # the row's own positions, a copy of its own
            kv = [(k[i : i + 1, :, w - n :].clone(), v[i : i + 1, :, w - n :].clone()) for k, v in layers]
        results.append(Prefilled(list(row.ids), logits[i, -1].float().clone(), numbers, kv))
    ms = (time.perf_counter() - started) * 1000 / len(rows)
    for r in results:
        r.ms = ms
    return results
