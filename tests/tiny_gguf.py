"""A tiny Llama GGUF written in-process with the gguf package's writer: the tiny tokenizer's
byte-level BPE vocabulary and merges, random weights, some of them Q8_0-quantized so that
loading it exercises transformers' dequantization. Seconds to write, kilobytes on disk."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONTEXT = 256


@dataclass(frozen=True)
class Dims:
    hidden: int = 64
    ffn: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2


# heads of 64 and every matrix whole 64-column panels: the shape whose packed layers run as two C
# calls a step (lmtrace.model.fused.layer)
PANELS = Dims(hidden=128, ffn=128, heads=2, kv_heads=1)


def _tensors(vocab: int, rng: np.random.Generator, dims: Dims) -> dict[str, np.ndarray]:
    hidden, ffn, head_dim = dims.hidden, dims.ffn, dims.hidden // dims.heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(dims.layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (dims.kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (dims.kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    out = {}
    for name, shape in shapes.items():
        scale = 0.5 if name == "output.weight" else 0.1
        out[name] = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else scale * rng.standard_normal(shape))
    return {k: v.astype(np.float32) for k, v in out.items()}


def write_tiny_gguf(
    path: str | Path, tokenizer, seed: int = 0, qtype: str = "Q8_0", dims: Dims = Dims(), float_q: bool = True
) -> Path:
    """Writes a 2-layer GQA Llama of `dims` with `tokenizer`'s vocabulary (a byte-level BPE
    PreTrainedTokenizerFast, as tests.tiny.tiny_tokenizer builds) to `path`; its matrices (but q,
    with `float_q`) as `qtype` blocks ("F16": float16, no packed form)."""
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
    w.add_embedding_length(dims.hidden)
    w.add_block_count(dims.layers)
    w.add_feed_forward_length(dims.ffn)
    w.add_head_count(dims.heads)
    w.add_head_count_kv(dims.kv_heads)
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
    for name, array in _tensors(len(tokens), rng, dims).items():
        if array.ndim == 2 and not (float_q and "attn_q" in name):  # quantized, as real files are; q F32
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
