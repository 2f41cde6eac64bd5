"""Batch-1 decoding on random-weight models of DeepSeek-R1-Distill-Qwen's shapes (Qwen2; 1.5B and
7B), on a GPU: `model.generate` eager, transformers' static cache compiled (`cache_implementation=
"static"`, `model.forward` torch.compile'd with mode="reduce-overhead"), lmtrace traced eager and
lmtrace `compile=True` (decode/static.py). Reported: tok/s, the share of the memory-bandwidth
limit (weight bytes x tok/s / --bandwidth: 4.8e12 B/s is an H200's), whether lmtrace compiled's
ids equal transformers' compiled ids (bfloat16), and the float32 max |Δ logprob| of lmtrace
compiled against lmtrace eager (same weights, float32). One contender's crash is recorded as its
result and the run goes on; the JSON is rewritten after every contender.

No tokenizer is downloaded: a word-level tokenizer over the whole vocabulary ("t0" ... "tN") is
built in-process, and the prompt is a run of its words. The import path needs torch,
transformers, tokenizers and lmtrace (PYTHONPATH=src) only: no fastapi, uvicorn or gguf.

Usage (via bench/decode.py --device ...):
  python bench/decode.py --device cuda [--shapes 1.5b,7b] [--tokens 128] [--out F.json]
  python bench/decode.py --device cpu --shapes tiny --tokens 16      # the script end to end, here"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {  # Qwen2 configs: DeepSeek-R1-Distill-Qwen-1.5B and -7B, and a tiny one to check the script
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
PROMPT_WORDS = 16


def tokenizer(vocab: int):
    """A word-level tokenizer whose ids are every id of the model ("t17" is id 17)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2")


def build(shape: str, device: str, dtype: torch.dtype):
    """A random-init Qwen2 model of the shape (seed 0), and the LM lmtrace wraps it in."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import lmtrace

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=10000.0,
                         eos_token_id=1, pad_token_id=2, bos_token_id=None, use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 2
    return lmtrace.LM.from_objects(model, tokenizer(config.vocab_size), source=f"random Qwen2 {shape}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: every parameter once (a tied lm_head is the embedding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def timed(fn: Callable[[], list[int]], device: str) -> tuple[list[int], float]:
    """(ids, seconds) of one run, the device drained before and after."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return ids, time.perf_counter() - start


def hf_eager(lm, prompt: torch.Tensor, n: int) -> list[int]:
    out = lm.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n, top_k=None, top_p=None, pad_token_id=2)
    return out[0, prompt.shape[1] :].tolist()


def hf_static_compiled(lm, prompt: torch.Tensor, n: int) -> list[int]:
    """transformers' documented recipe: a static cache and `model.forward` compiled (CUDA graphs on
    a GPU, fullgraph); `disable_compile` keeps generate from compiling its own wrapper around it."""
    model = lm.model
    if "forward" not in model.__dict__:
        mode = "reduce-overhead" if prompt.device.type == "cuda" else "default"
        model.forward = torch.compile(model.forward, mode=mode, fullgraph=True)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, top_k=None, top_p=None, pad_token_id=2,
                         cache_implementation="static", disable_compile=True)
    return out[0, prompt.shape[1] :].tolist()


def traced(lm, text: str, n: int, compile: bool, steps: list | None = None) -> list[int]:
    import lmtrace

    trace = lmtrace.generate(lm, text, max_new_tokens=n, temperature=0, top_logprobs=5, stop_on_eos=False,
                             compile=compile)
    if steps is not None:
        steps[:] = [s.logprob for s in trace.steps]
    return list(trace.token_ids)


def contenders(lm, text: str, prompt: torch.Tensor, n: int) -> dict[str, Callable[[], list[int]]]:
    return {
        "model.generate eager": lambda: hf_eager(lm, prompt, n),
        "transformers static cache compiled": lambda: hf_static_compiled(lm, prompt, n),
        "lmtrace traced eager": lambda: traced(lm, text, n, False),
        "lmtrace compile=True": lambda: traced(lm, text, n, True),
    }


def run_contender(name: str, fn: Callable[[], list[int]], device: str, warmups: int) -> dict:
    """Warm-up runs (the compile, the CUDA graphs' recording), then one timed run."""
    started = time.perf_counter()
    try:
        for _ in range(warmups):
            fn()
        warm_s = time.perf_counter() - started
        ids, seconds = timed(fn, device)
        return {"ids": ids, "seconds": seconds, "tok_s": len(ids) / seconds, "warmup_s": warm_s}
    except Exception as e:  # noqa: BLE001 - a contender's crash is its result
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
                "warmup_s": time.perf_counter() - started}


def float32_check(lm, text: str, n: int) -> dict:
    """lmtrace compile=True against lmtrace eager in float32 (the same weights, upcast)."""
    lm.model.to(torch.float32)
    try:
        eager, compiled = [], []
        ids_e = traced(lm, text, n, False, eager)
        ids_c = traced(lm, text, n, True, compiled)
        return {"tokens": n, "ids_equal": ids_e == ids_c,
                "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(eager, compiled))}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}


def one_shape(shape: str, args, record: dict, out: Path) -> None:
    started = time.perf_counter()
    lm = build(shape, args.device, torch.bfloat16)
    vocab = lm.model.config.vocab_size
    words = [f"t{(97 * i + 13) % vocab}" for i in range(PROMPT_WORDS)]
    text, prompt = " ".join(words), torch.tensor([[(97 * i + 13) % vocab for i in range(PROMPT_WORDS)]],
                                                   device=args.device)
    nbytes = weight_bytes(lm.model)
    entry = record["shapes"][shape] = {"config": SHAPES[shape], "weight_bytes": nbytes, "results": {}}
    for name, fn in contenders(lm, text, prompt, args.tokens).items():
        result = run_contender(name, fn, args.device, 1 if "eager" in name else 2)
        if name == "transformers static cache compiled":
            lm.model.__dict__.pop("forward", None)  # lmtrace's contenders run the model's own forward
        if "tok_s" in result:
            result["bandwidth_share"] = nbytes * result["tok_s"] / args.bandwidth
        entry["results"][name] = result
        _write(out, record)
    got = entry["results"]
    ours, theirs = got["lmtrace compile=True"].get("ids"), got["transformers static cache compiled"].get("ids")
    entry["ids_equal_to_transformers_compiled"] = None if ours is None or theirs is None else ours == theirs
    if shape in args.float32_shapes.split(","):
        entry["float32"] = float32_check(lm, text, min(args.tokens, 32))
    entry["seconds"] = time.perf_counter() - started
    del lm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    _write(out, record)


def table(record: dict) -> str:
    lines = ["| shape | contender | tok/s | share of the bandwidth limit | warm-up s |", "|---|---|---|---|---|"]
    for shape, entry in record["shapes"].items():
        for name, r in entry["results"].items():
            if "error" in r:
                lines.append(f"| {shape} | {name} | — | {r['error'][:120]} | {r['warmup_s']:.0f} |")
            else:
                lines.append(f"| {shape} | {name} | {r['tok_s']:.1f} | {r['bandwidth_share']:.1%} | "
                             f"{r['warmup_s']:.0f} |")
        lines.append(f"| {shape} | ids: lmtrace compiled = transformers compiled (bf16) | "
                     f"{entry.get('ids_equal_to_transformers_compiled')} | | |")
        if "float32" in entry:
            lines.append(f"| {shape} | float32: compiled vs eager | {json.dumps(entry['float32'])} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="1.5b,7b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per run (EOS ignored)")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="the card's memory bandwidth, B/s (H200)")
    ap.add_argument("--float32-shapes", default="1.5b,tiny", help="shapes whose float32 compiled-vs-eager is checked")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/decode-shapes-<time>.json)")
    args = ap.parse_args(argv)
    from lmtrace.versions import versions

    out = Path(args.out or f"bench/results/decode-shapes-{time.strftime('%Y%m%d-%H%M%S')}.json")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    record = {"device": device_name, "versions": versions(), "tokens": args.tokens, "batch": 1,
              "dtype": "bfloat16", "bandwidth": args.bandwidth, "shapes": {}}
    for shape in args.shapes.split(","):
        try:
            one_shape(shape, args, record, out)
        except Exception as e:  # noqa: BLE001 - a shape that cannot be built is recorded, the next runs
            record["shapes"].setdefault(shape, {})["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
    record["imported"] = {m: m in sys.modules for m in ("fastapi", "uvicorn", "gguf")}
    _write(out, record)
    print(table(record))
    print(f"\nwritten to {out}")


def _write(out: Path, record: dict) -> None:
    from lmtrace.files import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
