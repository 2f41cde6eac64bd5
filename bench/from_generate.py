"""What reading a model.generate run costs: model.generate with and without output_scores +
output_logits, then lmtrace.from_generate on its output, and lmtrace.generate on the same prompt
and settings, side by side on the bundled model (greedy, fp32, batch 1). The contenders alternate
within each round; medians of the rounds are printed as a Markdown table.
Usage: python bench/from_generate.py [--rounds 3] [--tokens 32]"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import lmtrace

PROMPT = "Write a short story about a lighthouse keeper:"


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    lm = lmtrace.load()
    ids = lm.tokenizer(PROMPT, return_tensors="pt")
    gen = {"do_sample": False, "max_new_tokens": args.tokens, "min_new_tokens": args.tokens}
    flags = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    ms: dict[str, list[float]] = {k: [] for k in ("generate", "generate+flags", "from_generate", "lmtrace.generate")}
    with torch.inference_mode():
        for _ in range(args.rounds):
            ms["generate"].append(timed(lambda: lm.model.generate(**ids, **gen))[0])
            t, out = timed(lambda: lm.model.generate(**ids, **gen, **flags))
            ms["generate+flags"].append(t)
            t, _ = timed(lambda o=out: lmtrace.from_generate(o, lm.tokenizer, model=lm.model, generation_config=gen))
            ms["from_generate"].append(t)
            ms["lmtrace.generate"].append(
                timed(lambda: lmtrace.generate(lm, PROMPT, max_new_tokens=args.tokens, temperature=0,
                                               stop_on_eos=False))[0]  # fmt: skip
            )
    print(f"bundled model, fp32, batch 1, greedy, {args.tokens} tokens, {args.rounds} rounds, "
          f"{platform.processor() or platform.machine()} × {os.cpu_count()} cores, torch {torch.__version__}")
    print("| contender | median ms | ms per token | ratio to generate |")
    print("|---|---|---|---|")
    base = statistics.median(ms["generate"])
    for name, values in ms.items():
        m = statistics.median(values)
        print(f"| {name} | {m:.1f} | {m / args.tokens:.2f} | {m / base:.3f} |")


if __name__ == "__main__":
    main()
