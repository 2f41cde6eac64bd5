"""Fidelity on the bundled model: lmtrace's numbers against transformers' own.

Greedy: token ids against model.generate and the largest |logprob - log_softmax(output_logits)|
over the whole vocabulary of every step. Sampled: the largest difference of the recorded raw and
processed logprobs against transformers' processors applied to an uncached forward pass.
Usage: python bench/fidelity.py [--tokens 32]"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import lmtrace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' transformers oracle
from tests.oracle import teacher_forced, teacher_forced_cached  # noqa: E402

PROMPTS = ["很久很久以前，", "🙂 wörld", "The capital of France is", "def fibonacci(n):"]
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2)


def greedy(lm, prompt: str, n: int) -> tuple[bool, float]:
    ids = lmtrace.encode_prompt(lm, prompt)
    trace = lmtrace.generate(lm, prompt, max_new_tokens=n, temperature=0, top_logprobs=0)
    x = torch.tensor([ids])
    out = lm.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                            output_logits=True, return_dict_in_generate=True, top_k=None, top_p=None,
                            pad_token_id=lm.pad_token_id)  # fmt: skip
    hf = out.sequences[0, len(ids) :].tolist()
    lp = torch.log_softmax(torch.cat([t.float() for t in out.logits]), -1)
    worst = max(abs(s.logprob - lp[i, s.token_id].item()) for i, s in enumerate(trace.steps))
    return trace.token_ids == hf, worst


def sampled(lm, prompt: str, n: int) -> tuple[float, float, float]:
    """Largest differences of the recorded raw and processed logprobs against transformers'
    processors on the logits of its own cached forward (as generate computes them), and of the
    raw logprobs against an uncached forward pass (float rounding between the two paths)."""
    trace = lmtrace.generate(lm, prompt, max_new_tokens=n, seed=1, top_logprobs=0, **SAMPLED)
    params = lmtrace.SamplingParams(**SAMPLED)
    ids, gen = trace.prompt["token_ids"], trace.token_ids
    raw, used = teacher_forced_cached(lm, ids, gen, params)
    uncached, _ = teacher_forced(lm, ids, gen, params)
    worst = lambda xs, key: max(abs(getattr(s, key) - x) for s, x in zip(trace.steps, xs))  # noqa: E731
    return worst(raw, "logprob"), worst(used, "sampled_logprob"), worst(uncached, "logprob")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    lm = lmtrace.load(device="cpu", dtype="float32")
    print("| prompt | greedy ids == generate | greedy: max abs diff vs output_logits | sampled: raw | processed "
          "| raw vs an uncached forward |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for prompt in PROMPTS:
        same, worst = greedy(lm, prompt, args.tokens)
        raw, used, uncached = sampled(lm, prompt, args.tokens)
        print(f"| {prompt!r} | {same} | {worst:.2e} | {raw:.2e} | {used:.2e} | {uncached:.2e} |")


if __name__ == "__main__":
    main()
