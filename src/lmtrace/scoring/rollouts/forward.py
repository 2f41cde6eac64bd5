"""Teacher-forced logits of many rollouts, batched: the distribution before each completion id.

Rollouts that share a long prompt (a GRPO group; SHARE_FROM) compute it once: one forward of
the prompt keeps its KV, then the group's completions go as one batch over that KV (each row
right-padded, the prompt's KV repeated per row). A rollout alone goes with others alone in one right-aligned
padded forward (lmtrace.decode.prefill's layout). Either way each rollout's logits are what its
own uncached forward gives, within float noise (the tests hold them to transformers' own)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence

import torch

from lmtrace.kv import ledger
from lmtrace.scoring.rollouts.rollout import Rollout

TOKENS = 2048  # padded tokens per forward: bounds the (rows, width, vocab) float32 logits
# a group computes its prompt once only where the prompt is at least this many times its mean
# completion: a forward over a cache with a mask costs more per token on a CPU than one plain
# padded forward (bench/rollouts.py, 32-token prompts and 128-token completions: slower shared)
SHARE_FROM = 1.0


def plan(rollouts: Sequence[Rollout]) -> tuple[list[list[int]], list[int]]:
    """(groups of rollout indices sharing a prompt, indices of rollouts whose prompt is theirs alone)."""
    by_prompt: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, r in enumerate(rollouts):
        by_prompt[tuple(r.prompt_ids)].append(i)

    def shares(g: list[int]) -> bool:
        mean = sum(len(rollouts[i].completion_ids) for i in g) / len(g)
        return len(g) > 1 and len(rollouts[g[0]].prompt_ids) >= SHARE_FROM * mean

    groups = [g for g in by_prompt.values() if shares(g)]
    alone = [i for g in by_prompt.values() if not shares(g) for i in g]
    return groups, alone


def _chunks(indices: Sequence[int], sizes: Mapping[int, int] | Sequence[int], budget: int) -> Iterator[list[int]]:
    """Indices, shortest first, in chunks of at most `budget` padded tokens (one at least)."""
    chunk: list[int] = []
    for i in sorted(indices, key=lambda i: sizes[i]):
        if chunk and (len(chunk) + 1) * sizes[i] > budget:
            yield chunk
            chunk = []
        chunk.append(i)
    if chunk:
        yield chunk


def _alone(model, rollouts: Sequence[Rollout], chunk: list[int], pad_id: int) -> Iterator[tuple[int, torch.Tensor]]:
    """One right-aligned padded forward of prompt + completion[:-1] per rollout."""
    seqs = [rollouts[i].prompt_ids + rollouts[i].completion_ids[:-1] for i in chunk]
    w = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), w), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), w), dtype=torch.long)
    for k, s in enumerate(seqs):
        ids[k, w - len(s) :] = torch.tensor(s)
        mask[k, w - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = bool((mask == 0).any())
    keep = max(len(rollouts[i].completion_ids) for i in chunk)
    device = model.device
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device) if padded else None,
        position_ids=pos.to(device),
        use_cache=False,
        logits_to_keep=keep,
    )
    logits = out.logits  # (rows, keep, vocab)
    for k, i in enumerate(chunk):
        n = len(rollouts[i].completion_ids)
        yield i, logits[k, keep - n :].float()  # (n, vocab): row j predicts completion_ids[j]


def _group(model, rollouts: Sequence[Rollout], group: list[int], budget: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The shared prompt once (its KV kept), then the completions in batches over that KV."""
    device = model.device
    prompt = rollouts[group[0]].prompt_ids
    p = len(prompt)
    cache = ledger.new_cache(model)
    out = model(input_ids=torch.tensor([prompt], device=device), logits_to_keep=1, **ledger.cache_kwargs(model, cache))
    first = out.logits[0, -1].float()  # (vocab,): predicts every completion's first id
    layers = ledger.layers_of(cache)  # per layer (1, kv_heads, p, head_dim)
    sizes = {i: max(1, len(rollouts[i].completion_ids) - 1) for i in group}
    for chunk in _chunks(group, sizes, budget):
        rows = [rollouts[i].completion_ids[:-1] for i in chunk]
        w = max(len(r) for r in rows)
        if w == 0:
            for i in chunk:
                yield i, first[None]
            continue
        ids = torch.full((len(rows), w), 0, dtype=torch.long)
        mask = torch.zeros((len(rows), p + w), dtype=torch.long)
        mask[:, :p] = 1
        for k, r in enumerate(rows):
            ids[k, : len(r)] = torch.tensor(r, dtype=torch.long) if r else ids[k, :0]
            mask[k, p : p + len(r)] = 1
        n = len(rows)  # the prompt's KV once per row: (1, h, p, d) -> (n, h, p, d)
        shared = ledger.cache_of(
            model, [(k.expand(n, -1, -1, -1).contiguous(), v.expand(n, -1, -1, -1).contiguous()) for k, v in layers]
        )
        pos = torch.arange(p, p + w).expand(len(rows), -1)
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            logits_to_keep=w,
            **ledger.cache_kwargs(model, shared),
        )
        logits = out.logits.float()  # (rows, w, vocab)
        for k, i in enumerate(chunk):
            n = len(rollouts[i].completion_ids)
            yield i, torch.cat([first[None], logits[k, : n - 1]])  # (n, vocab)


def forced_logits(
    model, rollouts: Sequence[Rollout], pad_id: int, budget: int = TOKENS
) -> Iterator[tuple[int, torch.Tensor]]:
    """(rollout index, logits (len(completion_ids), vocab) float32) for every rollout, in the
    order the batches finish: row j is the distribution before completion_ids[j]."""
    groups, alone = plan(rollouts)
    sizes = [len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts]
    with torch.inference_mode():
        for group in groups:
            yield from _group(model, rollouts, group, budget)
        for chunk in _chunks(alone, sizes, budget):
            yield from _alone(model, rollouts, chunk, pad_id)
