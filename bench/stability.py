"""The cost of each stability variant on the bundled model, as a multiple of one plain trace
(lmtrace.generate, greedy, the same prompt and length): building the variant (a copy in another
dtype, packing the GGUF, starting vLLM, ...), its first call (seconds: compile compiles there),
then teacher-forcing the reference's tokens under it and decoding the prompt under it (medians).
The ledger itself pays build + first forced + first decode per variant.

Medians over --rounds; printed as a Markdown table.
Usage: python bench/stability.py [--tokens 32] [--rounds 3] [--threads 1] [--vllm] [--compile] [--variant SPEC]"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import lmtrace
from lmtrace.scoring.stability.ledger import reference_of
from lmtrace.scoring.variants.spec import parse_variant
from lmtrace.scoring.variants.worlds import build

PROMPT = "Write a haiku about autumn leaves."


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the reference (a shared machine: 1)")
    ap.add_argument("--vllm", action="store_true", help="Also engine:vllm.")
    ap.add_argument("--compile", action="store_true", help="Also compile (minutes of compiling on a CPU).")
    ap.add_argument("--variant", action="append", default=None, help="Only these variants (repeatable).")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = lmtrace.load()
    kw = {"chat": True, "temperature": 0, "max_new_tokens": args.tokens, "top_logprobs": 2}
    trace = lmtrace.generate(lm, PROMPT, **kw)  # warm
    plain = statistics.median(timed(lambda: lmtrace.generate(lm, PROMPT, **kw)) for _ in range(args.rounds))
    ref = reference_of(lm, trace)
    params = lmtrace.SamplingParams(temperature=0, max_new_tokens=args.tokens, top_logprobs=2)
    specs = ["dtype:bfloat16", "dtype:float16", "weights:packed", "attention:eager", "batch:4",
             f"threads:{2 if args.threads == 1 else 1}"]  # fmt: skip
    specs += ["compile"] * args.compile + ["engine:vllm"] * args.vllm
    specs = args.variant or specs
    print(f"bundled SmolLM2-135M, {platform.machine()}, {args.threads} thread(s), {len(ref.ids)} prompt tokens, "
          f"{len(ref.tokens)} tokens; one plain trace: {plain:.2f} s (median of {args.rounds})\n")  # fmt: skip
    print("| variant | build (s) | first forced + decode (s) | forced (× trace) | decode (× trace) "
          "| forced + decode (× trace) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for spec in specs:
        started = time.perf_counter()
        world = build(lm, parse_variant(spec))
        build_s = time.perf_counter() - started
        first = timed(lambda w=world: w.forced(ref.ids + ref.tokens, len(ref.ids)))  # a compile compiles here
        first += timed(lambda w=world: w.decode(PROMPT, ref.ids, params, chat=True))
        forced = statistics.median(
            timed(lambda w=world: w.forced(ref.ids + ref.tokens, len(ref.ids))) for _ in range(args.rounds)
        )
        decode = statistics.median(
            timed(lambda w=world: w.decode(PROMPT, ref.ids, params, chat=True)) for _ in range(args.rounds)
        )
        cells = (f"{build_s:.1f}", f"{first:.1f}", f"{forced / plain:.2f}", f"{decode / plain:.2f}",
                 f"{(forced + decode) / plain:.2f}")  # fmt: skip
        print(f"| {spec} | {' | '.join(cells)} |", flush=True)
        world.close()


if __name__ == "__main__":
    main()
