"""`lmtrace sample -n N` against N sequential runs of the same seeds, on the bundled model, with
the uncertainty observer on in both (what `sample` records). Each round, side by side: the N
seeds decoded one after another with lmtrace.generate (the oracle), `sample -n N` (one
continuous batch), and `sample -n N --deepconf low`. Per round: tokens/s of each, the ratio,
whether every plain sample and every trace DeepConf kept is token-identical to its seed's lone
run, whether DeepConf's vote equals the offline vote over its kept traces, and the tokens it
saved against plain `-n N`. Each round's figures are written to --out as they come (a crash
keeps what was measured). Usage: python bench/sample.py [--rounds 3] [--n 16] [--tokens 32]
[--window 8] [--out bench-sample.json]"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import lmtrace
from lmtrace.decode.uncertainty import Uncertainty
from lmtrace.files import write_atomic
from lmtrace.samples import votes

PROMPT = "What is 17 + 25? Answer with a number."
REGEX = r"(\d+)"


def one_round(lm: lmtrace.LM, n: int, tokens: int, window: int) -> dict:
    settings = {"max_new_tokens": tokens, "temperature": 0.8, "chat": True}
    started = time.perf_counter()
    alone = [lmtrace.generate(lm, PROMPT, seed=s, uncertainty=Uncertainty(window=window), **settings) for s in range(n)]
    seq_s = time.perf_counter() - started
    started = time.perf_counter()
    plain = lmtrace.sample(lm, PROMPT, n, answer_regex=REGEX, confidence_window=window, **settings)
    batch_s = time.perf_counter() - started
    started = time.perf_counter()
    low = lmtrace.sample(lm, PROMPT, n, answer_regex=REGEX, confidence_window=window, deepconf="low", **settings)
    low_s = time.perf_counter() - started
    seq_tokens = sum(len(t.steps) for t in alone)
    by_index = dict(zip([e["index"] for e in low.samples if e["decoded"]], low.traces))
    kept = [e for e in low.samples if e["kept"]]
    offline = votes.weighted([e["answer"] for e in kept],
                             [by_index[e["index"]].uncertainty["deepconf"]["lowest_group"] for e in kept])  # fmt: skip
    return {
        "sequential_tok_s": seq_tokens / seq_s, "sample_tok_s": plain.scores["tokens"] / batch_s,
        "ratio": (plain.scores["tokens"] / batch_s) / (seq_tokens / seq_s),
        "plain_identical": [t.token_ids for t in plain.traces] == [a.token_ids for a in alone],
        "kept_identical": all(by_index[e["index"]].token_ids == alone[e["index"]].token_ids for e in kept),
        "vote_equal_offline": low.votes["deepconf"]["answer"] == offline["answer"],
        "plain_tokens": plain.scores["tokens"], "deepconf_tokens": low.scores["tokens"],
        "tokens_saved": plain.scores["tokens"] - low.scores["tokens"],
        "saved_fraction": 1 - low.scores["tokens"] / plain.scores["tokens"],
        "deepconf_kept": len(kept), "deepconf_stopped": sum(e["stopped"] is not None for e in low.samples),
        "plain_vote": plain.votes["majority"]["answer"], "deepconf_vote": low.votes["deepconf"]["answer"],
        "seconds": {"sequential": seq_s, "sample": batch_s, "deepconf": low_s},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--out", default="bench-sample.json")
    a = ap.parse_args()
    lm = lmtrace.load()
    found: dict = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                   "n": a.n, "tokens": a.tokens, "window": a.window, "rounds": []}  # fmt: skip
    for _ in range(a.rounds):
        try:
            found["rounds"].append(one_round(lm, a.n, a.tokens, a.window))
        except Exception as e:  # a crash keeps what was measured
            found["rounds"].append({"error": f"{type(e).__name__}: {e}"})
        write_atomic(a.out, json.dumps(found, indent=2))
        print(json.dumps(found["rounds"][-1]), flush=True)
    good = [x for x in found["rounds"] if "ratio" in x]
    if good:
        print(f"median ratio {statistics.median(x['ratio'] for x in good):.2f}x; median tokens saved "
              f"{statistics.median(x['tokens_saved'] for x in good)} of {good[0]['plain_tokens']}")  # fmt: skip


if __name__ == "__main__":
    main()
