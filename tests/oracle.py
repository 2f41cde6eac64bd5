"""transformers as the oracle: generate() with output_logits, and its own processors."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmtrace import SamplingParams


def hf_processors(params: SamplingParams) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if not params.greedy:
        if params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
        if params.min_p > 0:
            procs.append(MinPLogitsWarper(params.min_p))
    return procs


def hf_greedy(lm, prompt_ids: list[int], max_new_tokens: int, repetition_penalty: float = 1.0):
    """(generated ids, raw logits per step (steps, vocab)) from model.generate."""
    ids = torch.tensor([prompt_ids])
    out = lm.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        repetition_penalty=repetition_penalty,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=lm.eos_token_ids,
        pad_token_id=lm.pad_token_id,
        top_k=None,
        top_p=None,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat([x.float() for x in out.logits])


def teacher_forced(lm, prompt_ids: list[int], generated: list[int], params: SamplingParams):
    """Raw and processed log-probs of each generated token from one uncached forward pass."""
    seq = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        logits = lm.model(seq).logits[0].float()  # (len, vocab)
    procs = hf_processors(params)
    raw, used = [], []
    for i, tok in enumerate(generated):
        pos = len(prompt_ids) + i - 1
        row = logits[pos : pos + 1]
        processed = procs(seq[:, : pos + 1], row.clone())
        raw.append(torch.log_softmax(row, -1)[0, tok].item())
        used.append(torch.log_softmax(processed, -1)[0, tok].item())
    return raw, used


def teacher_forced_cached(lm, prompt_ids: list[int], generated: list[int], params: SamplingParams):
    """As teacher_forced, but through transformers' own DynamicCache one token at a time (the way
    model.generate computes each step), so only the processing is compared, not float rounding
    between a cached and an uncached forward pass."""
    from transformers import DynamicCache

    from lmtrace.kv.ledger import cache_kwargs  # only the keyword's name: `cache=` or `past_key_values=`

    seq = torch.tensor([prompt_ids + generated])
    cache = DynamicCache(config=lm.model.config)
    procs = hf_processors(params)
    raw, used = [], []
    with torch.no_grad():
        logits = lm.model(seq[:, : len(prompt_ids)], **cache_kwargs(lm.model, cache)).logits[:, -1].float()
        for i, tok in enumerate(generated):
            processed = procs(seq[:, : len(prompt_ids) + i], logits.clone())
            raw.append(torch.log_softmax(logits, -1)[0, tok].item())
            used.append(torch.log_softmax(processed, -1)[0, tok].item())
            step = seq[:, len(prompt_ids) + i : len(prompt_ids) + i + 1]
            logits = lm.model(step, **cache_kwargs(lm.model, cache)).logits[:, -1].float()
    return raw, used


def cached_logits(lm, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """The raw logits before each generated token (len(generated), vocab), through transformers'
    own DynamicCache one token at a time, as model.generate computes them."""
    from transformers import DynamicCache

    from lmtrace.kv.ledger import cache_kwargs  # only the keyword's name: `cache=` or `past_key_values=`

    seq = torch.tensor([prompt_ids + generated])
    cache = DynamicCache(config=lm.model.config)
    rows = []
    with torch.no_grad():
        # the prefill keeps the last position's logits only, as model.generate asks (logits_to_keep=1)
        prefill = lm.model(seq[:, : len(prompt_ids)], logits_to_keep=1, **cache_kwargs(lm.model, cache))
        logits = prefill.logits[:, -1].float()
        for i in range(len(generated)):
            rows.append(logits)
            step = seq[:, len(prompt_ids) + i : len(prompt_ids) + i + 1]
            logits = lm.model(step, **cache_kwargs(lm.model, cache)).logits[:, -1].float()
    return torch.cat(rows)
