"""A tiny Llama GGUF written in-process with the gguf package's writer: the tiny tokenizer's
byte-level BPE vocabulary and merges, random weights, some of them Q8_0-quantized so that
loading it exercises transformers' dequantization. Seconds to write, kilobytes on disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 128, 2, 4, 2, 256


def _tensors(vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    out = {}
    for name, shape in shapes.items():
        scale = 0.5 if name == "output.weight" else 0.1
        out[name] = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else scale * rng.standard_normal(shape))
    return {k: v.astype(np.float32) for k, v in out.items()}


def write_tiny_gguf(path: str | Path, tokenizer, seed: int = 0, qtype: str = "Q8_0") -> Path:
    """Writes a 2-layer GQA Llama with `tokenizer`'s vocabulary (a byte-level BPE
    PreTrainedTokenizerFast, as tests.tiny.tiny_tokenizer builds) to `path`; its matrices (but q)
    as `qtype` blocks ("F16": float16, no packed form)."""
    import gguf

    path = Path(path)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}")
    rng = np.random.default_rng(seed)
    for name, array in _tensors(len(tokens), rng).items():
        if array.ndim == 2 and "attn_q" not in name:  # quantized, as real files are; q stays F32
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
