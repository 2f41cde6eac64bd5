"""Side-by-side decoding speed on the bundled model: transformers' model.generate (plain, and
with output_scores + output_logits), lmtrace.generate (top_logprobs=20, full KV ledger), and
llama-cpp-python with logprobs when it is installed; batch sizes 1, 8, 16; teacher-forced
scoring; the machine's memory read bandwidth and each figure as a fraction of the bound.

The contenders alternate within every round; medians over rounds are reported.
Usage: python bench/decode.py [--rounds 3] [--tokens 64] [--batch-sizes 1,8,16] [--bf16]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import lmtrace
from lmtrace.versions import versions

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important ideas in physics are",
    "Write a short poem about the moon:",
    "很久很久以前，",
    "def fibonacci(n):",
    "The capital of France is",
    "In 1969, the first humans",
    "A good cup of coffee needs",
]


def bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth: the best of several full reads of a buffer far larger than caches."""
    x = torch.ones(size_mb * 1024 * 1024 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per decode step (tied tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def hf_generate(lm, prompts: list[str], n: int, scores: bool) -> int:
    lm.tokenizer.padding_side = "left"
    if lm.tokenizer.pad_token_id is None:
        lm.tokenizer.pad_token_id = lm.pad_token_id
    enc = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    extra = {"output_scores": True, "output_logits": True, "return_dict_in_generate": True} if scores else {}
    out = lm.model.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n, top_k=None, top_p=None,
                            pad_token_id=lm.pad_token_id, **extra)  # fmt: skip
    seq = out.sequences if scores else out
    return (seq.shape[1] - enc["input_ids"].shape[1]) * len(prompts)


def traced(lm, prompts: list[str], n: int, compile: bool = False, **inside: bool) -> int:
    traces = lmtrace.generate(lm, prompts, max_new_tokens=n, temperature=0, top_logprobs=20, stop_on_eos=False,
                              compile=compile, **inside)  # fmt: skip
    return sum(len(t.steps) for t in traces)


# inside each step (lmtrace.lens, lmtrace.attention), compared with the plain traced contender
INSIDE = {"lens": {"lens": True}, "attention": {"attention": True},
          "lens + attention": {"lens": True, "attention": True}}  # fmt: skip


def inside_contenders(lm, n: int) -> dict[str, Callable[[list[str]], int]]:
    return {f"lmtrace.generate + {k}": (lambda p, kw=kw: traced(lm, p, n, **kw)) for k, kw in INSIDE.items()}


def json_bytes_per_step(lm, n: int) -> dict[str, dict[str, float]]:
    """The trace JSON's size per step, plain and with each inside option, at top_logprobs 5 and 20."""
    out = {}
    for top in (5, 20):
        for name, kw in {"plain": {}, **INSIDE}.items():
            t = lmtrace.generate(lm, PROMPTS[0], max_new_tokens=n, temperature=0, top_logprobs=top, stop_on_eos=False,
                                 **kw)  # fmt: skip
            out.setdefault(f"top_logprobs={top}", {})[name] = len(t.to_json().encode()) / len(t.steps)
    return out


def llama_cpp(n: int) -> Callable[[list[str]], int] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(lmtrace.loading.bundled_gguf()), n_ctx=512, logits_all=True, verbose=False,
                n_threads=torch.get_num_threads())  # fmt: skip

    def run(prompts: list[str]) -> int:
        out = llm.create_completion(prompts[0], max_tokens=n, temperature=0, logprobs=5)
        return out["usage"]["completion_tokens"]

    return run


def score_rate(lm, rounds: int) -> list[float]:
    text = " ".join(PROMPTS) * 8
    ids = torch.tensor([lm.tokenizer(text)["input_ids"][:1024]])
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        if hasattr(lmtrace, "score"):
            lmtrace.score(lm, lm.tokenizer.decode(ids[0]))
        else:
            with torch.inference_mode():
                torch.log_softmax(lm.model(ids).logits.float(), -1)
        rates.append(ids.shape[1] / (time.perf_counter() - start))
    return rates


def contenders(lm, lm_bf16, n: int, batch: int, compile: bool = False, inside: bool = False) -> dict[str, Callable]:
    found = {
        "model.generate": lambda p: hf_generate(lm, p, n, False),
        "model.generate + output_scores/logits": lambda p: hf_generate(lm, p, n, True),
        "lmtrace.generate (top_logprobs=20, KV ledger)": lambda p: traced(lm, p, n),
    }
    if inside:
        found |= inside_contenders(lm, n)
    if lm_bf16 is not None:
        found["lmtrace.generate bfloat16"] = lambda p: traced(lm_bf16, p, n)
    if compile and batch == 1:  # the warm-up round pays the one-off compile
        found["lmtrace.generate --compile (static cache)"] = lambda p: traced(lm, p, n, compile=True)
    if batch == 1 and (cpp := llama_cpp(n)) is not None:
        found["llama-cpp-python (logprobs=5)"] = cpp
    return found


def measure(lm, lm_bf16, n: int, batch: int, rounds: int, compile: bool = False, inside: bool = False) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    runs = contenders(lm, lm_bf16, n, batch, compile, inside)
    for run in runs.values():  # warm-up (with the batch's own shapes, for the compiled contender)
        run(prompts)
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens = run(prompts)
            rates[name].append(tokens / (time.perf_counter() - start))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,16")
    ap.add_argument("--bf16", action="store_true", help="also time lmtrace on a bfloat16 copy of the model")
    ap.add_argument("--compile", action="store_true", help="also time lmtrace --compile at batch 1 (a one-off compile)")
    ap.add_argument("--inside", action="store_true", help="also time --lens, --attention and both")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/decode-<time>.json)")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    lm = lmtrace.load(device="cpu", dtype="float32")
    lm_bf16 = lmtrace.load(device="cpu", dtype="bfloat16") if args.bf16 else None
    gbs = bandwidth_gbs()
    wbytes = weight_bytes(lm.model)
    rows, results = [], {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        rates = measure(lm, lm_bf16, args.tokens, batch, args.rounds, args.compile, args.inside)
        base = statistics.median(rates["model.generate"])
        for name, values in rates.items():
            med = statistics.median(values)
            wb = wbytes / 2 if "bfloat16" in name else wbytes
            bound = batch * gbs * 1e9 / wb
            rows.append(f"| {name} | {batch} | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} "
                        f"| {med / base:.2f} | {med / bound:.0%} |")  # fmt: skip
            results[f"{name} @ batch {batch}"] = {"median": med, "runs": values, "ratio": med / base, "bound": bound}
    scoring = score_rate(lm, args.rounds)
    print(f"bundled SmolLM2-135M-Instruct, CPU ({torch.get_num_threads()} threads), greedy, {args.tokens} new tokens, "
          f"{args.rounds} rounds; memory read bandwidth {gbs:.1f} GB/s; weights {wbytes / 1e6:.0f} MB per step "
          f"(float32) -> bound {gbs * 1e9 / wbytes:.1f} tok/s at batch 1\n")  # fmt: skip
    print("| contender | batch | median tok/s | runs | ratio to model.generate | of bandwidth bound |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nteacher-forced scoring (1024 tokens, float32): median {statistics.median(scoring):.0f} tok/s")
    if args.inside:
        results["inside"] = inside_summary(results, args.batch_sizes, json_bytes_per_step(lm, 16))
    record = {"machine": {"platform": platform.platform(), "processor": _cpu_name(), "cores": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "bandwidth_gbs": gbs},
              "versions": versions(), "tokens": args.tokens, "rounds": args.rounds, "weight_bytes": wbytes,
              "results": results, "scoring_tok_s": scoring}  # fmt: skip
    out = Path(args.out or f"bench/results/decode-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwritten to {out}")


def inside_summary(results: dict, batch_sizes: str, sizes: dict) -> dict:
    """Step time of each inside option over the plain traced one (the goal: lens + attention <= 1.5x)."""
    plain = "lmtrace.generate (top_logprobs=20, KV ledger)"
    print("\n| inside each step | batch | step time / plain traced |\n|---|---|---|")
    ratios = {}
    for batch in [int(b) for b in batch_sizes.split(",")]:
        for k in INSIDE:
            rate = results[f"lmtrace.generate + {k} @ batch {batch}"]["median"]
            r = results[f"{plain} @ batch {batch}"]["median"] / rate
            ratios[f"{k} @ batch {batch}"] = r
            print(f"| {k} | {batch} | {r:.2f}x |")
    print("\nJSON bytes per step (bundled model, 30 layers):")
    for top, row in sizes.items():
        print(f"  {top}: " + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in row.items()))
    return {"step_time_ratio": ratios, "json_bytes_per_step": sizes}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
