"""Teacher-forced scoring throughput (tokens/s) of lmtrace.score on the bundled model, next to a
plain forward pass over the same tokens (the floor: what any scorer must pay).

The contenders alternate over several rounds on the same model, text and machine; medians are
printed as a Markdown table. Usage: python bench/score.py [--rounds 5] [--tokens 512]"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import lmtrace

PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
    "father had taught him. From the lamp room he could see the harbour, the fishing boats coming "
    "home, and the long grey line of the coast disappearing into the fog. "
)


def text_of(lm, tokens: int) -> str:
    text = PARAGRAPH
    while len(lm.tokenizer(text)["input_ids"]) < tokens:
        text += PARAGRAPH
    ids = lm.tokenizer(text)["input_ids"][:tokens]
    return lm.tokenizer.decode(ids)


def plain_forward(lm, ids: torch.Tensor) -> int:
    with torch.inference_mode():
        lm.model(input_ids=ids, use_cache=False)
    return ids.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--top-logprobs", type=int, default=5)
    args = ap.parse_args()
    lm = lmtrace.load(device="cpu", dtype="float32")
    text = text_of(lm, args.tokens)
    ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
    contenders = {
        "model(ids) forward only": lambda: plain_forward(lm, ids),
        f"lmtrace.score (top_logprobs={args.top_logprobs})": lambda: len(
            lmtrace.score(lm, text, top_logprobs=args.top_logprobs).token_ids
        ),
        "lmtrace.score (top_logprobs=0)": lambda: len(lmtrace.score(lm, text, top_logprobs=0).token_ids),
    }
    for run in contenders.values():  # warm-up
        run()
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, run in contenders.items():
            start = time.perf_counter()
            n = run()
            rates[name].append(n / (time.perf_counter() - start))
    print(f"{ids.shape[1]} tokens, {args.rounds} rounds, torch threads {torch.get_num_threads()}, {platform.machine()}")
    print("| contender | median tok/s | min | max |\n|---|---:|---:|---:|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.0f} | {min(r):.0f} | {max(r):.0f} |")
    print(json.dumps({k: statistics.median(v) for k, v in rates.items()}))


if __name__ == "__main__":
    main()
