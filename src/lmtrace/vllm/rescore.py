"""lmtrace's own numbers for the tokens vLLM chose: one teacher-forced forward pass of the
transformers model over prompt + generated tokens (no cache), in float32.

They give what vLLM's single logprobs mode leaves out (the other distribution, the entropies)
and the check of what vLLM reported: the same tokens under the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmtrace import forced, sampling
from lmtrace.loading import LM
from lmtrace.params import SamplingParams
from lmtrace.score import forward_windows, resolve_window
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
    prompt: forced.Forced | None = None  # the prompt's tokens from position 1 on (echo)


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


def rescore(
    lm: LM, prompt_ids: Sequence[int], generated: Sequence[int], params: SamplingParams, top_n: int, echo: bool = False
) -> Rescored:
    """lmtrace's numbers for `generated` after `prompt_ids`; with `echo` also the prompt's own."""
    ids = list(prompt_ids) + list(generated)
    first = 1 if echo else len(prompt_ids)
    logits = _logits(lm, ids, first)  # (len(ids) - first, vocab)
    prompt = None
    if echo:
        targets = torch.tensor(ids[1 : len(prompt_ids)])
        prompt = forced.measure_targets(logits[: len(prompt_ids) - 1], targets, top_n)
    steps = logits[len(prompt_ids) - first :]  # (generated, vocab)
    with torch.inference_mode():
        raw = torch.log_softmax(steps, -1)
        seen = _seen(prompt_ids, generated, steps.shape[-1], steps.device)
        used = torch.log_softmax(process_like_vllm(steps, params, seen), -1)
        chosen = torch.tensor(list(generated), device=steps.device)[:, None]  # (generated, 1)
        lp = raw.gather(-1, chosen)
        rank = (raw > lp).sum(-1) + 1  # the same rule as lmtrace's loop
        top_lp, top_ids = torch.topk(raw, top_n, dim=-1) if top_n else (raw[:, :0], chosen[:, :0])
        return Rescored(
            logprob=lp[:, 0].tolist(),
            rank=rank.tolist(),
            entropy=sampling.entropy(raw).tolist(),
            sampled_logprob=used.gather(-1, chosen)[:, 0].tolist(),
            sampled_entropy=sampling.entropy(used).tolist(),
            top_ids=top_ids.tolist(),
            top_logprobs=top_lp.tolist(),
            processed=used,
            prompt=prompt,
        )
