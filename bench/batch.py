"""Aggregate tokens/s of a batch job's engines at several batch sizes on the bundled model.

Each round runs one batch of every size on every engine (greedy, N new tokens, end tokens
ignored so every row makes all N), engines and sizes alternating within the round; a batch's
rate is all its rows' tokens over its wall time, records and JSON lines included (as `lmtrace
batch` writes them, less the file). `--engine vllm` (or `both`) adds vLLM (lmtrace.vllm: vLLM
decodes, lmtrace rescores and writes the same records) and vLLM's bare decoding with logprobs
(no traces), for where the time goes. Medians and ratios are printed as a Markdown table.
Usage: python bench/batch.py [--engine local|vllm|both] [--rounds 3] [--tokens 64] [--sizes 1 8 16] [--threads N]"""

from __future__ import annotations

import argparse
import json
import os
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


def run_local(lm: lmtrace.LM, size: int, defaults: dict) -> tuple[int, bool]:
    outcomes = list(trace_lines(lm, lines(size), defaults, batch_size=size))
    return sum(o.tokens for o in outcomes), any(o.error for o in outcomes)


def run_vllm(engine, size: int, defaults: dict) -> tuple[int, bool]:
    from lmtrace.batch.vllm_engine import trace_lines_vllm

    outcomes = list(trace_lines_vllm(engine, lines(size), defaults, batch_size=size))
    return sum(o.tokens for o in outcomes), any(o.error for o in outcomes)


def run_vllm_bare(engine, size: int, params: SamplingParams) -> tuple[int, bool]:
    """vLLM's own decoding with the same logprobs, no records: the floor of the vLLM engine."""
    from lmtrace.vllm.params import to_vllm

    prompts = [{"prompt_token_ids": engine.lm.tokenizer(line.data["prompt"])["input_ids"]} for line in lines(size)]
    outs = engine.llm.generate(prompts, [to_vllm(params, engine.lm.eos_token_ids)] * size, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), False


def timed(fn, *args) -> float:
    start = time.perf_counter()
    tokens, failed = fn(*args)
    elapsed = time.perf_counter() - start
    assert not failed, f"{fn.__name__} wrote error lines"
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["local", "vllm", "both"], default="local")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:  # vLLM runs in this process: the same threads for both engines
        torch.set_num_threads(args.threads)
    lm = lmtrace.load(device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_new_tokens=args.tokens, stop_on_eos=False)
    defaults = defaults_of(params)
    contenders = {}
    if args.engine in ("local", "both"):
        contenders["local"] = lambda size: timed(run_local, lm, size, defaults)
    if args.engine in ("vllm", "both"):
        from lmtrace.vllm import VLLMEngine

        engine = VLLMEngine.start(lm, None)
        contenders["vllm"] = lambda size: timed(run_vllm, engine, size, defaults)
        contenders["vllm, no traces"] = lambda size: timed(run_vllm_bare, engine, size, params)
    for run in contenders.values():
        run(2)  # warm-up
    rates: dict[str, dict[int, list[float]]] = {name: {size: [] for size in args.sizes} for name in contenders}
    for _ in range(args.rounds):
        for size in args.sizes:
            for name, run in contenders.items():
                rates[name][size].append(run(size))
    print(
        f"bundled model, float32, CPU ({os.cpu_count()} cores, torch {torch.get_num_threads()} threads), greedy, "
        f"{args.tokens} new tokens, top_logprobs {params.top_logprobs}, {args.rounds} rounds\n"
    )
    first = next(iter(contenders))
    print(f"| engine | batch size | median tok/s (all rows) | runs | ratio to {first} |\n|---|---|---|---|---|")
    for size in args.sizes:
        base = statistics.median(rates[first][size])
        for name in contenders:
            values = rates[name][size]
            med = statistics.median(values)
            print(f"| {name} | {size} | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {med / base:.2f} |")
    meta = {"machine": platform.platform(), "load_average": os.getloadavg(), "torch": torch.__version__,
            "rates": rates}  # fmt: skip
    print("\n" + json.dumps(meta))


if __name__ == "__main__":
    main()
