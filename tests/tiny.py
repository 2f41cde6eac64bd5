"""A tiny world built in-process: a byte-level BPE tokenizer trained on a few sentences and a
random-init Llama-style model with grouped-query attention. No download, seconds to build."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little model that counted tokens.",
    "很久很久以前，有一个小模型。",
    "🙂 wörld, naïve café, größer.",
] * 4


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def tiny_config(vocab_size: int, eos_id: int, pad_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )


def tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = tiny_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    # a larger init spreads the logits so that top-k/top-p/min-p really cut something
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def plain_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE without the byte alphabet (no byte fallback): a character the corpus lacks ("Q")
    has no token at all."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<eos>", "<pad>", "<unk>"], show_progress=False)
    tok.train_from_iterator(CORPUS[:2], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE with a BOS its post-processor puts before every text (as Gemma's
    and Llama's tokenizers do): encode("Hello") is [<bos>, ...]; its offset mapping gives the BOS (0, 0)."""
    from tokenizers import processors

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<pad>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", bos)])  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")
