"""Tokens/s of lmtrace.generate against transformers' model.generate on the bundled model.

The contenders alternate over several rounds on the same model, prompt and machine; medians and
ratios are printed as a Markdown table. Usage: python bench/generate_vs_hf.py [--rounds 3]"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import lmtrace


def hf(lm, ids, n, scores):
    extra = {"output_scores": True, "output_logits": True, "return_dict_in_generate": True} if scores else {}
    out = lm.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=lm.pad_token_id,
        top_k=None,
        top_p=None,
        **extra,
    )
    seq = out.sequences if scores else out
    return seq.shape[1] - ids.shape[1]


def traced(lm, prompt, n):
    trace = lmtrace.generate(lm, prompt, max_new_tokens=n, temperature=0, top_logprobs=20, stop_on_eos=False)
    return len(trace.steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Once upon a time, in a small village by the sea,")
    args = ap.parse_args()
    lm = lmtrace.load(device="cpu", dtype="float32")
    ids = torch.tensor([lmtrace.encode_prompt(lm, args.prompt)])
    contenders = {
        "model.generate": lambda: hf(lm, ids, args.tokens, False),
        "model.generate + output_scores/logits": lambda: hf(lm, ids, args.tokens, True),
        "lmtrace.generate (top_logprobs=20)": lambda: traced(lm, args.prompt, args.tokens),
    }
    for run in contenders.values():  # warm-up
        run()
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, run in contenders.items():
            start = time.perf_counter()
            n = run()
            rates[name].append(n / (time.perf_counter() - start))
    base = statistics.median(rates["model.generate"])
    print(
        f"bundled model, float32, CPU ({torch.get_num_threads()} threads), batch 1, greedy, "
        f"{args.tokens} new tokens, {args.rounds} rounds\n"
    )
    print("| contender | median tok/s | runs | ratio to model.generate |\n|---|---|---|---|")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {med / base:.2f} |")
    meta = {"machine": platform.platform(), "torch": torch.__version__, "rates": rates}
    print("\n" + json.dumps(meta))


if __name__ == "__main__":
    main()
