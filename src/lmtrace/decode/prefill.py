"""Many prompts prefilled together: padded forwards grouped by length, each prompt starting from
the longest beginning a prefix cache holds (lmtrace.kv.prefix). The one batched teacher-forced
path: a list of texts scored (lmtrace.score), the server's echo and scoring requests, and the
server's generations before they join the running batch all run it.

One forward holds k rows; row i reuses r_i cached tokens and computes its L_i = n_i - r_i others:

    row i:  [pad P - r_i][reused r_i] | [pad W - L_i][new L_i]     P = max r, W = max L

The reused KV is left-padded to P, the new tokens right-aligned in W columns, so every row's
last token sits in the last column; a row alone with nothing reused is exactly engine.prefill's
forward (no mask, positions 0..n-1), the same numbers to the bit. Padding is masked out of
every real position; rows are grouped by the length they compute, so padding stays small."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmtrace.kv import ledger
from lmtrace.kv.prefix import KV, Hit, PrefixCache
from lmtrace.logits import measure

ROWS = 16  # rows per forward
TOKENS = 1024  # padded tokens per forward: bounds the (rows, width, vocab) float logits
MIN_GAIN = 8  # tokens a row must gain by waiting for another row of the same call to be cached
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
) -> list[Prefilled]:
    """Prefills every row, in order; with a `cache`, each row that shares reuses its longest
    cached beginning and is kept in the cache afterwards. `keep_kv`: every result carries its KV."""
    if cache is not None:
        cache.check_weights(model)
    keep = keep_kv or cache is not None
    out: list[Prefilled | None] = [None] * len(rows)
    with torch.inference_mode():
        for wave in _waves(rows, cache):
            hits = {i: _lookup(cache, rows[i]) for i in wave}
            for i in [i for i in wave if hits[i] is not None and hits[i].reuse == len(rows[i].ids)]:
                out[i] = _from_cache(rows[i], hits.pop(i))  # asked before: no forward at all
            wave = [i for i in wave if i in hits]
            sizes = {i: len(rows[i].ids) - (hits[i].reuse if hits[i] else 0) for i in wave}
            for group in groups(wave, sizes, [rows[i].top_n is not None for i in wave], max_rows, max_tokens):
                done = _forward(model, [rows[i] for i in group], [hits[i] for i in group], pad_id, keep)
                for i, p in zip(group, done):
                    out[i] = p
                    if cache is not None and rows[i].share:
                        measured = p.numbers if rows[i].first <= 1 else None  # a partial record is not kept
                        cache.insert(p.ids, p.kv, measured, rows[i].top_n or 0, p.logits)
    return out  # type: ignore[return-value]


def _lookup(cache: PrefixCache | None, row: PromptRow) -> Hit | None:
    if cache is None or not row.share:
        return None
    return cache.lookup(row.ids, row.top_n)


def _from_cache(row: PromptRow, hit: Hit) -> Prefilled:
    """A prompt that is a cached one: its numbers, distribution and KV as they were computed."""
    t0 = max(row.first, 1)
    numbers = hit.numbers(row.ids, row.top_n, t0) if row.top_n is not None else None
    return Prefilled(list(row.ids), hit.entry.last.clone(), numbers, hit.entry.kv, hit.reuse)


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of tokens two sequences share at their beginning."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _waves(rows: Sequence[PromptRow], cache: PrefixCache | None) -> list[list[int]]:
    """[indices] in the order to run: a row that shares a long beginning with an earlier row of
    this call (but not with the cache) waits for a second wave, which reuses what the first
    computed (the choices of a multiple-choice question arrive together)."""
    if cache is None or len(rows) < 2 or cache.max_bytes == 0:
        return [list(range(len(rows)))]
    cached = [h.reuse if (h := cache.lookup(r.ids, r.top_n, count=False)) else 0 for r in rows]
    first: list[int] = [i for i, r in enumerate(rows) if not r.share]
    second: list[int] = []
    anchor = None
    for i in sorted((i for i, r in enumerate(rows) if r.share), key=lambda i: rows[i].ids):  # side by side
        row = rows[i]
        if anchor is not None:
            a = rows[anchor]
            serves = row.top_n is None or (a.top_n is not None and a.first <= 1 and a.top_n >= row.top_n)
            if serves and common(a.ids, row.ids) - 1 >= cached[i] + MIN_GAIN:
                second.append(i)
                continue
        first.append(i)
        anchor = i
    return [sorted(first), sorted(second)] if second else [sorted(first)]


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


def _layout(rows: Sequence[PromptRow], reuse: list[int], pad_id: int, device) -> tuple:
    """Input ids (k, W), attention mask (k, P + W) or None, position ids (k, W)."""
    new = [len(r.ids) - u for r, u in zip(rows, reuse)]
    p, w = max(reuse), max(new)
    ids = torch.full((len(rows), w), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), p + w), dtype=torch.long)
    pos = torch.zeros((len(rows), w), dtype=torch.long)
    for i, (row, u, n) in enumerate(zip(rows, reuse, new)):
        ids[i, w - n :] = torch.tensor(row.ids[u:], dtype=torch.long)
        mask[i, p - u : p] = 1
        mask[i, p + w - n :] = 1
        pos[i, w - n :] = torch.arange(u, u + n)
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


def _past(model, hits: Sequence[Hit | None], width: int):
    """The reused KV of every row, left-padded to `width`, as one cache (None when none)."""
    if width == 0:
        return None
    return ledger.cache_of(model, stack_left([h.kv() if h is not None else None for h in hits], width))


def _forward(model, rows: Sequence[PromptRow], hits: Sequence[Hit | None], pad_id: int, keep: bool) -> list[Prefilled]:
    started = time.perf_counter()
    reuse = [h.reuse if h is not None else 0 for h in hits]
    p = max(reuse)
    ids, mask, pos = _layout(rows, reuse, pad_id, model.device)
    w = ids.shape[1]
    cache = _past(model, hits, p)
    if cache is None and keep:
        cache = ledger.new_cache(model)
    measured = any(r.top_n is not None for r in rows)
    kwargs = ledger.cache_kwargs(model, cache) if cache is not None else {"use_cache": False}
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=w if measured else 1, **kwargs)
    logits = out.logits  # (k, w or 1, vocab)
    layers = ledger.layers_of(cache) if keep else None
    results = []
    for i, (row, hit, u) in enumerate(zip(rows, hits, reuse)):
        n = len(row.ids) - u
        numbers = None
        if row.top_n is not None:
            t0 = max(row.first, 1)
            t = max(t0, u + 1)  # the first target this forward measures; those before come from the cache
            fresh = measure.targets(logits[i, w - 1 - (len(row.ids) - t) : w - 1], torch.tensor(row.ids[t:]), row.top_n)
            numbers = hit.numbers(row.ids, row.top_n, t0) if hit is not None and t0 <= u else measure.Forced()
            numbers.extend(fresh)
        kv = None
        if layers is not None:  # the row's own positions: its reused part and its new tokens
            kv = [(_own(k, i, p, u, w - n), _own(v, i, p, u, w - n)) for k, v in layers]
        results.append(Prefilled(list(row.ids), logits[i, -1].float().clone(), numbers, kv, u))
    ms = (time.perf_counter() - started) * 1000 / len(rows)
    for r in results:
        r.ms = ms
    return results


def _own(t: torch.Tensor, row: int, p: int, reused: int, start: int) -> torch.Tensor:
    """Row `row`'s positions of a layer's (k, kv_heads, P + W, head_dim) keys or values: its
    `reused` ones before column P and its new ones from column P + `start`, as (1, kv_heads,
    n, head_dim), a copy of its own."""
    return torch.cat([t[row : row + 1, :, p - reused : p], t[row : row + 1, :, p + start :]], dim=2)
