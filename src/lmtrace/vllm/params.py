"""lmtrace's SamplingParams as vLLM's, and vLLM's order of the processors.

vLLM applies them in another order than lmtrace (and transformers): logit bias -> repetition
penalty -> temperature -> min-p -> top-k -> top-p (vllm/v1/sample/sampler.py). The two agree
unless min-p is combined with top-k or top-p; the rescoring of a vLLM trace uses vLLM's order, so that its
processed numbers are those of the distribution vLLM sampled from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmtrace.logits import processors
from lmtrace.params import SamplingParams

VLLM_ORDER = "logit_bias -> repetition_penalty -> temperature -> min_p -> top_k -> top_p"


def to_vllm(params: SamplingParams, eos_token_ids: Sequence[int], echo: bool = False) -> Any:
    """vllm.SamplingParams of one request. The end tokens are lmtrace's (the model's generation
    config), given explicitly so that both engines stop on the same ones."""
    if params.constraint is not None:  # vLLM's logprobs would be of the masked logits: not rescored yet
        raise ValueError(f"{params.constraint}: --engine vllm does not trace constrained decoding; use --engine local")
    from vllm import SamplingParams as VllmParams

    return VllmParams(
        n=1,
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        seed=params.seed,
        stop=list(params.stop) or None,
        stop_token_ids=list(eos_token_ids) if params.stop_on_eos else None,
        ignore_eos=not params.stop_on_eos,
        logprobs=params.top_logprobs,  # 0 still returns the chosen token's own logprob
        prompt_logprobs=params.top_logprobs if echo else None,
        include_stop_str_in_output=False,
        logit_bias=dict(params.logit_bias) or None,
    )


def process_like_vllm(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """The distribution vLLM samples from, as logits (rows, vocab): the same processors in vLLM's
    order (lmtrace.logits.processors.VLLM_ORDER). Greedy applies only the logit bias and the penalty."""
    return processors.process(logits, params, seen, processors.VLLM_ORDER)
