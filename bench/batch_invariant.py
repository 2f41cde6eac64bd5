"""The batch-invariant mode's cost and its numbers against the default path, on the bundled model:
decode at batch 1 (`generate`), a decoded batch of 8, a teacher-forced batch (rollouts), each
default then invariant, alternating over `--repeats` so that a busy machine weighs on both alike;
and whether the thread count changes the invariant numbers (the same decode at 1 and 2 threads).

    python bench/batch_invariant.py [--tokens 32] [--repeats 3]

The server at 1, 8 and 16 clients: `lmtrace serve --batch-invariant` against `lmtrace serve`,
each measured with bench/serve_concurrent.py against the running server."""

from __future__ import annotations

import argparse
import json
import time

import torch

import lmtrace
from lmtrace.model.invariant import mode

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "2+2=",
           "Write a haiku about the sea:", "The three laws of motion are", "def fibonacci(n):",
           "A recipe for bread:", "In 1969, the first"]  # fmt: skip


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def runs(lm, tokens: int) -> dict[str, object]:
    """The three workloads once: (name -> seconds)."""
    kw = {"max_new_tokens": tokens, "temperature": 0, "top_logprobs": 5, "stop_on_eos": False}
    trace = lmtrace.generate(lm, PROMPTS[0], **kw)
    records = [{"id": str(i), "prompt_ids": trace.prompt["token_ids"], "completion_ids": trace.token_ids,
                "logprobs": [s.logprob for s in trace.steps]} for i in range(8)]  # fmt: skip
    return {
        "generate batch 1 (s)": timed(lambda: lmtrace.generate(lm, PROMPTS[0], **kw)),
        "generate batch 8 (s)": timed(lambda: lmtrace.generate(lm, PROMPTS, **kw)),
        "teacher-forced 8 rollouts (s)": timed(lambda: lmtrace.rollouts(lm, records)),
        "logprobs": [s.logprob for s in trace.steps],
    }


def threads(lm, tokens: int) -> bool:
    """Whether the invariant decode gives the same bits at 1 and at 2 threads."""
    before = torch.get_num_threads()
    got = []
    for n in (1, 2):
        torch.set_num_threads(n)
        t = lmtrace.generate(lm, PROMPTS[:3], max_new_tokens=tokens, temperature=0, top_logprobs=5)
        got.append([[(s.token_id, s.logprob, s.entropy) for s in x.steps] for x in t])
    torch.set_num_threads(before)
    return got[0] == got[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lm = lmtrace.load()
    runs(lm, 2)  # warm: the first forward's one-off costs
    totals: dict[str, dict[str, list[float]]] = {"default": {}, "invariant": {}}
    logprobs = {}
    for _ in range(args.repeats):
        for name in ("default", "invariant"):
            if name == "invariant":
                mode.install(lm.model)
            got = runs(lm, args.tokens)
            logprobs[name] = got.pop("logprobs")
            for k, v in got.items():
                totals[name].setdefault(k, []).append(v)
            mode.remove(lm.model)
    best = {name: {k: min(v) for k, v in d.items()} for name, d in totals.items()}
    mode.install(lm.model)
    report = {
        "best of repeats": best,
        "ratio invariant / default": {k: best["invariant"][k] / best["default"][k] for k in best["default"]},
        "max |invariant - default| logprob": max(
            abs(a - b) for a, b in zip(logprobs["default"], logprobs["invariant"])
        ),
        "invariant bits the same at 1 and 2 threads": threads(lm, min(args.tokens, 8)),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
