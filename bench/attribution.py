"""What attribution costs a decoding step: the bundled model at batch 1, greedy, the same prompt
and length, a plain step against a step with `attribution=True` (every part and every head),
and with the logit lens for scale. Per round each contender decodes once (the contenders in
turn, so a busy shared machine slows them alike); a step's time is the engine's own `time_ms`
of the decoding steps (the prefill's step 0 left out), the median over a round's steps, then the
median over rounds. Goal: attribution ≤ 1.5× plain.

Writes what it measured (--out, JSON) after every round, a contender's crash recorded as its
error; prints a Markdown table.
Usage: python bench/attribution.py [--tokens 32] [--rounds 5] [--threads 1] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import lmtrace

PROMPT = "Write a haiku about autumn leaves."
CONTENDERS = {"plain": {}, "attribution": {"attribution": True}, "lens": {"lens": True}}


def step_ms(lm, tokens: int, extra: dict) -> float:
    """The median decoding-step time (ms) of one greedy generation."""
    trace = lmtrace.generate(lm, PROMPT, chat=True, temperature=0, max_new_tokens=tokens, stop_on_eos=False,
                             top_logprobs=5, **extra)  # fmt: skip
    return statistics.median(s.time_ms for s in trace.steps[1:])


def write(path: Path, found: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=2))
    tmp.replace(path)


def summary(found: dict) -> dict:
    """Per contender: the median step over rounds, its ratio to plain's, and the median of the
    per-round ratios (each round's contenders ran back to back: robust to a machine that drifts)."""
    rounds = found["rounds"]
    medians = {name: statistics.median(ms) for name, ms in rounds.items() if ms}
    base = medians.get("plain")
    out = {}
    for name, m in medians.items():
        pairs = [a / b for a, b in zip(rounds[name], rounds.get("plain", [])) if b]
        out[name] = {"median_step_ms": m, "ratio_to_plain": m / base if base else None,
                     "median_round_ratio": statistics.median(pairs) if pairs else None}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a shared machine: 1)")
    ap.add_argument("--out", default="bench/results/attribution.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = lmtrace.load()
    found: dict = {"machine": platform.machine(), "threads": args.threads, "tokens": args.tokens,
                   "rounds": {n: [] for n in CONTENDERS}, "errors": {}, "started": time.time()}  # fmt: skip
    for extra in CONTENDERS.values():  # warm: the first generation pays one-off costs
        step_ms(lm, 4, extra)
    for _ in range(args.rounds):
        for name, extra in CONTENDERS.items():
            if name in found["errors"]:
                continue
            try:
                found["rounds"][name].append(step_ms(lm, args.tokens, extra))
            except Exception as e:  # a contender's crash is a result too
                found["errors"][name] = f"{type(e).__name__}: {e}"
        found["summary"] = summary(found)
        write(Path(args.out), found)
    print(f"bundled SmolLM2-135M, {platform.machine()}, {args.threads} thread(s), batch 1, {args.tokens} tokens, "
          f"median of {args.rounds} rounds\n")  # fmt: skip
    print("| contender | median step (ms) | × plain | median of round ratios |\n|---|---:|---:|---:|")
    for name, s in found["summary"].items():
        print(f"| {name} | {s['median_step_ms']:.2f} | {s['ratio_to_plain']:.3f} | {s['median_round_ratio']:.3f} |")
    for name, error in found["errors"].items():
        print(f"| {name} | failed: {error} | |")


if __name__ == "__main__":
    main()
