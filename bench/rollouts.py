"""lmtrace.rollouts on the bundled model against a bare batched forward over the same tokens:
N sequences of `--tokens` completion tokens in GRPO groups of `--group` sharing a prompt.

The bare forward is the floor any scorer pays: every sequence's prompt + completion in padded
batches of 16, logits kept for the completion, nothing measured. lmtrace.rollouts computes the
raw and processed logprobs of every token, the metrics and the causes (the engine's logprobs are
the bare forward's own, so the rollouts are clean: the cost of a clean file). The arms are
interleaved: the N sequences go in `--slices` slices of whole groups, each slice through the
bare forward, then through lmtrace.rollouts (a report per slice, so that memory stays bounded
at any N: 10,000 sequences in 100 slices hold 100 sequences' report at a time); each round
(`--runs`) goes over every slice. The JSON is written after each slice, so a crash keeps what
was measured. Usage (the issue's full size: --sequences 10000 --slices 100):
python bench/rollouts.py --sequences 200 --tokens 128 --slices 4 --runs 1 --json bench/results/rollouts.json"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import lmtrace
from lmtrace.files import write_atomic

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
    "taught him. From the lamp room he could see the harbour, the fishing boats coming home, and the long grey "
    "line of the coast disappearing into the fog. 很久很久以前，有一座山。 def add(a, b): return a + b "
)


def make(lm, sequences: int, tokens: int, group: int, prompt: int) -> list[dict]:
    """Rollouts whose ids are slices of a text (real tokens), logprobs filled in later."""
    ids = lm.tokenizer(TEXT * 40)["input_ids"]
    out = []
    for i in range(sequences):
        g = i // group
        p = ids[g * 7 % 300 : g * 7 % 300 + prompt]
        start = 400 + (i * 13) % (len(ids) - 400 - tokens)
        out.append({"id": str(i), "prompt_ids": p, "completion_ids": ids[start : start + tokens],
                    "sampling": {"temperature": 1.0}})  # fmt: skip
    return out


def bare(lm, records: list[dict], batch: int = 16) -> tuple[float, list[list[float]]]:
    """(seconds of the forwards alone, the raw logprobs of every completion token)."""
    seconds, logprobs = 0.0, []
    for k in range(0, len(records), batch):
        rows = [r["prompt_ids"] + r["completion_ids"] for r in records[k : k + batch]]
        n = len(records[k]["completion_ids"])
        x = torch.tensor(rows)  # (batch, prompt + tokens): every row has the same length here
        started = time.perf_counter()
        with torch.inference_mode():
            logits = lm.model(input_ids=x, use_cache=False, logits_to_keep=n + 1).logits[:, :-1]  # (batch, n, vocab)
        seconds += time.perf_counter() - started
        lp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, -n:, None])[..., 0]
        logprobs += lp.tolist()
    return seconds, logprobs


def slices(n: int, group: int, k: int) -> list[range]:
    """k slices of the n sequences (about equal, whole groups each; fewer where there are fewer groups)."""
    groups = -(-n // group)
    k = max(1, min(k, groups))
    cuts = [min(n, group * (groups * i // k)) for i in range(k + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def one_slice(lm, records: list[dict]) -> dict:
    """One slice through both arms, the bare forward first (its logprobs are the engine's)."""
    row: dict = {"sequences": len(records)}
    try:
        seconds, logprobs = bare(lm, records)
        row["bare_s"] = seconds
        for r, lp in zip(records, logprobs):
            r["logprobs"] = lp
    except Exception as e:  # a contender's crash is recorded, the other still runs
        row["bare_error"] = repr(e)
    try:
        if "logprobs" in records[0]:
            started = time.perf_counter()
            report = lmtrace.rollouts(lm, records, caps=[2])
            row["rollouts_s"] = time.perf_counter() - started
            row["causes"] = report["summary"]["causes"]
            row["outside_0_9_1_1"] = report["summary"]["outside_0_9_1_1"]
    except Exception as e:
        row["rollouts_error"] = repr(e)
    if "bare_s" in row and "rollouts_s" in row:
        row["ratio"] = row["rollouts_s"] / row["bare_s"]
    return row


def totals(result: dict, tokens_per_sequence: int) -> None:
    """The whole run's figures from the slices done so far: sums per arm, ms per token, ratios."""
    done = [r for r in result["slices"] if "ratio" in r]
    if not done:
        return
    bare_s, roll_s = sum(r["bare_s"] for r in done), sum(r["rollouts_s"] for r in done)
    tokens = sum(r["sequences"] for r in done) * tokens_per_sequence
    result.update({"tokens_measured": tokens, "bare_s": bare_s, "rollouts_s": roll_s,
                   "bare_ms_per_token": 1000 * bare_s / tokens, "rollouts_ms_per_token": 1000 * roll_s / tokens,
                   "ratio": roll_s / bare_s, "median_slice_ratio": statistics.median(r["ratio"] for r in done),
                   "clean": all(r["causes"] == [] and r["outside_0_9_1_1"] == 0.0 for r in done)})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--slices", type=int, default=4, help="slices of whole groups, each through both arms in turn")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", default="bench/results/rollouts.json")
    a = ap.parse_args()
    lm = lmtrace.load()
    records = make(lm, a.sequences, a.tokens, a.group, a.prompt)
    parts = slices(len(records), a.group, a.slices)
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "sequences": a.sequences, "tokens": a.tokens, "group": a.group, "prompt": a.prompt,
              "slices_per_run": len(parts), "runs": a.runs, "slices": []}  # fmt: skip
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    for run in range(a.runs):
        for k, part in enumerate(parts):
            row = {"run": run, "slice": k, **one_slice(lm, [dict(records[i]) for i in part])}
            result["slices"].append(row)
            totals(result, a.tokens)
            write_atomic(a.json, json.dumps(result, indent=2) + "\n")
            print(json.dumps(row), flush=True)
    got = result.get
    print(f"rollouts / bare forward: {got('ratio')} over {got('tokens_measured')} tokens "
          f"({got('rollouts_ms_per_token')} against {got('bare_ms_per_token')} ms per token)")  # fmt: skip


if __name__ == "__main__":
    main()
