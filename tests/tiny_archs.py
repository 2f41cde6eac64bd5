"""Tiny random-init models of four architectures for the lens and attention tests, sharing the
tiny tokenizer: Llama (GQA), Qwen2 with a sliding-window layer, Gemma-2 (alternating sliding
layers, attention and final-logit soft-capping, eager attention) and GPT-2 (tied wte, ln_f)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from lmtrace.model.lm import LM

ARCHS = ("llama", "qwen2", "gemma2", "gpt2")


def config(arch: str, vocab: int, eos: int, pad: int):
    common = dict(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
    if arch == "llama":
        return LlamaConfig(**common, **small, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "qwen2":  # layers 1 and 2 slide over a 4-token window
        return Qwen2Config(**common, **small, num_key_value_heads=2, max_position_embeddings=128,
                           use_sliding_window=True, sliding_window=4, max_window_layers=1)  # fmt: skip
    if arch == "gemma2":
        return Gemma2Config(**common, **small, num_key_value_heads=2, head_dim=16, sliding_window=4,
                            max_position_embeddings=128, final_logit_softcapping=3.0,
                            attn_logit_softcapping=5.0)  # fmt: skip
    if arch == "gpt2":
        return GPT2Config(**common, n_embd=64, n_layer=3, n_head=4, n_positions=128)
    raise ValueError(arch)


def tiny_arch(arch: str, tok: PreTrainedTokenizerFast, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(arch, len(tok), tok.eos_token_id, tok.pad_token_id))
    with torch.no_grad():  # spread the logits so ranks and the settling layer vary
        model.get_output_embeddings().weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return LM.from_objects(model.eval(), tok, source=f"tiny-{arch}")


def final_head(arch: str, model):
    """(final norm, unembedding weight, soft-cap) written out by hand per architecture."""
    if arch == "gpt2":
        return model.transformer.ln_f, model.transformer.wte.weight, None
    cap = model.config.final_logit_softcapping if arch == "gemma2" else None
    return model.model.norm, model.lm_head.weight, cap


def gemma3_config(vocab: int, eos: int, pad: int, layer_types: list[str], window: int, head_dim: int = 16):
    """A Gemma-3-style text config: sliding and full layers mixed as `layer_types` says, one KV head."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad, bos_token_id=None, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=len(layer_types), num_attention_heads=4,
                            num_key_value_heads=1, head_dim=head_dim, sliding_window=window,
                            layer_types=layer_types, max_position_embeddings=2048)  # fmt: skip


def tiny_gemma3(tok: PreTrainedTokenizerFast, layer_types: list[str], window: int, head_dim: int = 16,
                seed: int = 0) -> LM:  # fmt: skip
    """A random-init Gemma-3-style model (mixed sliding and full layers) on the tiny tokenizer."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gemma3_config(len(tok), tok.eos_token_id, tok.pad_token_id, layer_types,
                                                           window, head_dim))  # fmt: skip
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return LM.from_objects(model.eval(), tok, source="tiny-gemma3")
