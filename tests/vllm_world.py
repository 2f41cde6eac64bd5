"""The tiny world for vLLM: its CPU attention needs head_dim >= 32 (tests/tiny.py's model has
16), so the same tokenizer with a Llama of hidden size 128 over 4 heads, saved as a folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmtrace.detokenize import TokenBytes

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# the marker of every test that runs vLLM, and why it is skipped where vLLM is not installed
needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'lmtrace[vllm]', see the README)"),
]


def tiny_model_32(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # spread the logits, as tests/tiny.py does, so that filters cut something
        model.lm_head.weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def save_tiny_32(tokenizer, path: Path) -> Path:
    tiny_model_32(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _entry(tb: TokenBytes, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tb.text(token_id), "logprob": max(logprob, -9999.0), "bytes": list(tb(token_id))}


def chat_response(result: Any, tokenizer: Any, prompt: str | None = None) -> dict[str, Any]:
    """A vLLM RequestOutput as an OpenAI chat response's `logprobs.content`, for compare:
    {"request": {"prompt"}, "response": {"choices": [{"logprobs": {"content": [...]}}]}}."""
    tb = TokenBytes(tokenizer)
    output = result.outputs[0]
    content = []
    for token, numbers in zip(output.token_ids, output.logprobs or []):
        item = _entry(tb, token, numbers[token].logprob)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in numbers.items() if lp.rank is not None)
        item["top_logprobs"] = [_entry(tb, t, lp) for _, t, lp in ranked]
        content.append(item)
    text = tokenizer.decode(list(output.token_ids))
    response = {"choices": [{"index": 0, "text": text, "logprobs": {"content": content}}]}
    return {"request": {"prompt": prompt}, "response": response} if prompt is not None else response
