"""lmtrace's own numbers for the tokens vLLM chose: one teacher-forced forward pass of the
transformers model over prompt + generated tokens (no cache), in float32.

They give what vLLM's single logprobs mode leaves out (the other distribution, the entropies)
and the check of what vLLM reported: the same tokens under the same weights."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from lmtrace.logits import measure
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.scoring.teacher.score import forward_windows, resolve_window
from lmtrace.vllm.params import process_like_vllm


@dataclass
class Rescored:
    """Per generated token (lists indexed by step); `top_*` the raw top-n."""

    logprob: list[float]
    rank: list[int]
    entropy: list[float]
    sampled_logprob: list[float]
    sampled_entropy: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    processed: torch.Tensor  # (steps, vocab) processed logprobs, for alternatives looked up later
    prompt: measure.Forced | None = None  # the prompt's tokens from position 1 on (echo)


def _seen(prompt_ids: Sequence[int], generated: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """(steps, vocab): the tokens in the sequence before each step (the repetition penalty's view)."""
    seen = torch.zeros((len(generated), vocab), dtype=torch.bool, device=device)
    seen[:, list(prompt_ids)] = True
    for i in range(1, len(generated)):
        seen[i] = seen[i - 1]
        seen[i, generated[i - 1]] = True
    return seen


def _logits(lm: LM, ids: list[int], first: int) -> torch.Tensor:
    """(len(ids) - first, vocab) float32: row j predicts ids[first + j]."""
    window = resolve_window(lm.model, None, None)
    with torch.inference_mode():
        parts = [rows.float() for _, rows in forward_windows(lm.model, ids, first, *window)]
    return torch.cat(parts)


# logits kept per forward pass of several rows: rows x positions x vocab x 4 bytes at most this
BATCH_LOGITS_BYTES = 256 << 20


def _logits_rows(lm: LM, seqs: list[list[int]], firsts: list[int]) -> Iterator[torch.Tensor]:
    """_logits of each sequence in turn, right-padded into forward passes of several rows. No
    mask is needed: the padding comes after every real token, which a causal model never attends
    to. One pass's logits are alive at a time."""
    vocab = lm.model.config.vocab_size
    start = 0
    while start < len(seqs):
        width = max(len(s) for s in seqs[start:])
        rows = max(1, min(len(seqs) - start, BATCH_LOGITS_BYTES // (width * vocab * 4)))
        chunk = seqs[start : start + rows]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), lm.pad_token_id, dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, : len(s)] = torch.tensor(s)
        with torch.inference_mode():
            logits = lm.model(input_ids=ids.to(lm.model.device), use_cache=False).logits  # (rows, width, vocab)
        for r, s in enumerate(chunk):
            yield logits[r, firsts[start + r] - 1 : len(s) - 1].float()  # row j predicts s[first + j]
        start += rows


def rescore_many(lm: LM, items: list[tuple[list[int], list[int], SamplingParams, bool]]) -> Iterator[Rescored]:
    """rescore for (prompt_ids, generated, params, echo) of several requests, in order, their
    forward passes batched."""
    seqs = [list(p) + list(g) for p, g, _, _ in items]
    firsts = [1 if echo else len(p) for p, _, _, echo in items]
    for logits, (p, g, params, echo) in zip(_logits_rows(lm, seqs, firsts), items):
        yield _numbers(logits, p, g, params, params.top_logprobs, echo)


def rescore(
    lm: LM, prompt_ids: Sequence[int], generated: Sequence[int], params: SamplingParams, top_n: int, echo: bool = False
) -> Rescored:
    """lmtrace's numbers for `generated` after `prompt_ids`; with `echo` also the prompt's own."""
    ids = list(prompt_ids) + list(generated)
    first = 1 if echo else len(prompt_ids)
    return _numbers(_logits(lm, ids, first), prompt_ids, generated, params, top_n, echo)


def _numbers(
    logits: torch.Tensor, prompt_ids: Sequence[int], generated: Sequence[int], params: SamplingParams, top_n: int,
    echo: bool,
) -> Rescored:  # fmt: skip
    """`logits` (len(ids) - first, vocab) over prompt + generated, from position `first` on."""
    ids = list(prompt_ids) + list(generated)
    first = 1 if echo else len(prompt_ids)
    prompt = None
    if echo:
        targets = torch.tensor(ids[1 : len(prompt_ids)])
        prompt = measure.targets(logits[: len(prompt_ids) - 1], targets, top_n)
    steps = logits[len(prompt_ids) - first :]  # (generated, vocab)
    with torch.inference_mode():
        raw = torch.log_softmax(steps, -1)
        seen = _seen(prompt_ids, generated, steps.shape[-1], steps.device)
        used = torch.log_softmax(process_like_vllm(steps, params, seen), -1)
        chosen = torch.tensor(list(generated), device=steps.device)[:, None]  # (generated, 1)
        lp = raw.gather(-1, chosen)
        top_lp, top_ids = torch.topk(raw, top_n, dim=-1) if top_n else (raw[:, :0], chosen[:, :0])
        return Rescored(
            logprob=lp[:, 0].tolist(),
            rank=measure.rank(raw, lp).tolist(),
            entropy=measure.entropy(raw).tolist(),
            sampled_logprob=used.gather(-1, chosen)[:, 0].tolist(),
            sampled_entropy=measure.entropy(used).tolist(),
            top_ids=top_ids.tolist(),
            top_logprobs=top_lp.tolist(),
            processed=used,
            prompt=prompt,
        )
