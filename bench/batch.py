"""Aggregate tokens/s of a batch job's engine at batch sizes 1, 8 and 16 on the bundled model.

Each round runs one batch of every size (greedy, 64 new tokens, end tokens ignored so every
row makes all 64), the sizes alternating within the round; a batch's rate is all its rows'
tokens over its wall time, records and JSON lines included (as `lmtrace batch` writes them,
less the file). Medians and the ratio to batch 1 are printed as a Markdown table.
Usage: python bench/batch.py [--rounds 3] [--tokens 64] [--sizes 1 8 16]"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import lmtrace
from lmtrace.batch import InputLine, defaults_of, trace_lines
from lmtrace.params import SamplingParams

TOPICS = ["a lighthouse", "a lost key", "the first snow", "a clockmaker", "an old map", "a quiet river"]


def lines(n: int) -> list[InputLine]:
    """n prompts of similar (not equal) length, so that a batch pads a little, as real ones do."""
    out = []
    for i in range(n):
        prompt = f"Write a short story about {TOPICS[i % len(TOPICS)]}, number {i + 1}:"
        out.append(InputLine(i + 1, i, {"id": i, "prompt": prompt}))
    return out


def rate(lm: lmtrace.LM, size: int, defaults: dict) -> float:
    start = time.perf_counter()
    outcomes = list(trace_lines(lm, lines(size), defaults, batch_size=size))
    elapsed = time.perf_counter() - start
    assert not any(o.error for o in outcomes), [o.line for o in outcomes if o.error]
    return sum(o.tokens for o in outcomes) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16])
    args = ap.parse_args()
    lm = lmtrace.load(device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_new_tokens=args.tokens, stop_on_eos=False)
    defaults = defaults_of(params)
    rate(lm, 2, defaults)  # warm-up
    rates: dict[int, list[float]] = {size: [] for size in args.sizes}
    for _ in range(args.rounds):
        for size in args.sizes:
            rates[size].append(rate(lm, size, defaults))
    base = statistics.median(rates[args.sizes[0]])
    print(
        f"bundled model, float32, CPU ({torch.get_num_threads()} threads), greedy, {args.tokens} new tokens, "
        f"top_logprobs {params.top_logprobs}, {args.rounds} rounds\n"
    )
    print(f"| batch size | median tok/s (all rows) | runs | ratio to batch {args.sizes[0]} |\n|---|---|---|---|")
    for size, values in rates.items():
        med = statistics.median(values)
        print(f"| {size} | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {med / base:.2f} |")
    meta = {"machine": platform.platform(), "torch": torch.__version__, "rates": rates}
    print("\n" + json.dumps(meta))


if __name__ == "__main__":
    main()
