"""What fusing the small operations of a decoder layer would give on this CPU, measured before
building it (issue 50, item 1): lmtrace.generate on the bundled model, float32 `--matmul onednn`,
greedy, `--tokens` tokens with the end token ignored, `top_logprobs` 1, at each batch size, with
each Llama decoder layer computed by one of these variants, interleaved in every round, medians:

- `onednn`: the library's own layer path (lmtrace.model.layer_path), the reference;
- `post-add`: the residual adds fused into the o_proj and down_proj products (oneDNN's binary
  "add" post-op: the product and the add in one call);
- `post-add+swish`: also the MLP as two products with post-ops, gate with "swish" (SiLU) and up
  with a binary "mul" by that, in place of one grouped gate/up product, SiLU and the multiply;
- `compiled-small`: the layer's small regions (RMSNorm, the rotary embedding, SiLU times up) each
  a torch.compile'd function (Inductor's C++ kernels), the products as in `onednn`;
- `fused`: the library's `--matmul onednn-fused` (lmtrace.model.fused): RMSNorm, the residual add
  with the RMSNorm after it, the rotary embedding and SiLU·mul each one call of a small C library.

Each variant's tokens and largest |Δ logprob| to `onednn` close the table (an opt-in kernel path
may move logprobs 5e-5). The first three variants are written here, not in the library: none
was faster beyond the noise (docs/performance.md, "Fusing the small operations"); the C library
was, and is the library's (`--variants onednn,fused`).

Usage: python bench/fusions.py [--batch-sizes 8,16] [--rounds 6] [--tokens 32] [--threads 1]
       [--variants onednn,post-add,post-add+swish,compiled-small,fused] [--json bench/results/fusions.json]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import PROMPTS  # noqa: E402

import lmtrace  # noqa: E402
from lmtrace.model import layer_path, matmul  # noqa: E402

LINEAR = torch.ops.mkldnn._linear_pointwise


@torch.compile(dynamic=True, fullgraph=True)
def _c_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(h, (h.shape[-1],), w, eps)


@torch.compile(dynamic=True, fullgraph=True)
def _c_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rotary_pos_emb(q, k, cos, sin)


@torch.compile(dynamic=True, fullgraph=True)
def _c_silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def _norm(norm: Any, x: torch.Tensor, compiled: bool) -> torch.Tensor:
    if compiled:
        return _c_norm(x, norm.weight, norm.variance_epsilon)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _attention(self: Any, x: torch.Tensor, b: int, s: int, mask: Any, cache: Any, emb: Any, kw: dict, compiled: bool):
    """q/k/v in one grouped product, rotary, the cache and transformers' attention: (rows, hidden)."""
    attn = self.self_attn
    heads, kv = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    qkv = matmul.together([attn.q_proj, attn.k_proj, attn.v_proj], x).view(b, s, heads + 2 * kv, attn.head_dim)
    q, k = qkv[:, :, :heads].transpose(1, 2), qkv[:, :, heads : heads + kv].transpose(1, 2)
    v = qkv[:, :, heads + kv :].transpose(1, 2)
    cos, sin = emb
    q, k = _c_rotary(q, k, cos, sin) if compiled else apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kw)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **kw)
    return out.reshape(b * s, -1).contiguous()


def variant(name: str) -> Callable:
    """A LlamaDecoderLayer forward for the variant `name` (see the module's docstring)."""
    post, swish, compiled = name.startswith("post-add"), name.endswith("swish"), name == "compiled-small"

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):  # fmt: skip
        b, s, d = hidden_states.shape
        rows = hidden_states.reshape(b * s, d)
        kw = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
        x = _norm(self.input_layernorm, hidden_states, compiled)
        out = _attention(self, x, b, s, attention_mask, cache, position_embeddings, kw, compiled)
        o_proj, mlp = self.self_attn.o_proj, self.mlp
        if post:
            h = LINEAR.binary(out, rows, matmul.packed_weight(o_proj), None, "add")
        else:
            h = rows + matmul.linear(o_proj, out)
        x = _norm(self.post_attention_layernorm, h, compiled)
        if swish:
            gate = LINEAR(x, matmul.packed_weight(mlp.gate_proj), None, "swish", [], "")
            act = LINEAR.binary(x, gate, matmul.packed_weight(mlp.up_proj), None, "mul")
        else:
            gate_up = matmul.together([mlp.gate_proj, mlp.up_proj], x)
            inter = mlp.gate_proj.out_features
            act = _c_silu_mul(gate_up, inter) if compiled else F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        if post:
            y = LINEAR.binary(act, h, matmul.packed_weight(mlp.down_proj), None, "add")
        else:
            y = h + matmul.linear(mlp.down_proj, act)
        return y.view(b, s, d)

    return forward


def switched_layers(lm: Any) -> list[Any]:
    """The decoder layers the library's layer path switched (each variant replaces their forward)."""
    layers = [m for m in lm.model.modules() if layer_path.switched(m)]
    if not layers:
        raise SystemExit("no decoder layer is on the oneDNN layer path: is this a Llama model?")
    return layers


def use(lm: Any, layers: list[Any], name: str) -> None:
    """Puts the variant's forward on these layers (`onednn`: the layer path's own again; `fused`:
    the layer path's with its C kernels)."""
    forward = layer_path.forward if name in ("onednn", "fused") else variant(name)
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    if layer_path.fuse(lm.model, name == "fused") != (len(layers) if name == "fused" else 0):
        raise SystemExit("the C kernels were not used on every layer")


def run(lm: Any, prompts: list[str], tokens: int) -> tuple[float, list[list[int]], list[list[float]]]:
    started = time.perf_counter()
    traces = lmtrace.generate(lm, prompts, max_new_tokens=tokens, temperature=0, top_logprobs=1, stop_on_eos=False)
    seconds = time.perf_counter() - started
    return seconds, [[s.token_id for s in t.steps] for t in traces], [[s.logprob for s in t.steps] for t in traces]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="8,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="onednn,post-add,post-add+swish,compiled-small,fused")
    ap.add_argument("--json", type=Path, default=Path("bench/results/fusions.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    lm = lmtrace.load(device="cpu", dtype="float32", matmul="onednn")
    layers = switched_layers(lm)
    record: dict[str, Any] = {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "rows": []}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        seconds: dict[str, list[float]] = {n: [] for n in names}
        first: dict[str, tuple] = {}
        for name in names:  # warm-up (and the compiled variant's compiling), the numbers kept
            use(lm, layers, name)
            _, ids, lps = run(lm, prompts, args.tokens)
            first[name] = (ids, lps)
        for _ in range(args.rounds):
            for name in names:
                use(lm, layers, name)
                seconds[name].append(run(lm, prompts, args.tokens)[0])
        ref_ids, ref_lps = first[names[0]]
        for name in names:
            ids, lps = first[name]
            delta = max(abs(a - b) for r, q in zip(lps, ref_lps) for a, b in zip(r, q))
            rate = batch * args.tokens / statistics.median(seconds[name])
            record["rows"].append({"variant": name, "batch": batch, "tok_s": round(rate, 1),
                                   "same_tokens": ids == ref_ids, "max_abs_delta": delta})  # fmt: skip
        use(lm, layers, "onednn")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(args.json)
    print(f"| variant | batch | tok/s (median of {args.rounds}) | ratio | same tokens | max abs Δ logprob |")
    print("|---|---:|---:|---:|---|---:|")
    for row in record["rows"]:
        ref = next(r for r in record["rows"] if r["batch"] == row["batch"] and r["variant"] == names[0])
        print(f"| {row['variant']} | {row['batch']} | {row['tok_s']} | {row['tok_s'] / ref['tok_s']:.3f} | "
              f"{row['same_tokens']} | {row['max_abs_delta']:.2g} |")  # fmt: skip


if __name__ == "__main__":
    main()
