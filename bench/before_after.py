"""A change's cost to the library's decoding, side by side: lmtrace.generate on the bundled model
(float32, greedy, `--tokens` tokens with the end token ignored, top-5 logprobs) at batch 1 and at
batch 16 (`generate([...])`), run by this checkout's lmtrace and by another's (`--before DIR`, a
git worktree of an earlier commit), each in a child process of its own (its src/ first on the
path), the two interleaved in every round, medians over rounds. A child that crashes or times out
is that round's result, written down; the table and the JSON are written after every round.
Also whether the two give the same token ids and logprobs (a refactor of the loop must not move a
number).

    git worktree add /tmp/before <commit>
    python bench/before_after.py --before /tmp/before [--rounds 5] [--tokens 64] [--threads 1]
           [--json bench/results/before_after.json]

The child (`--child`) loads the model once, warms up, then times each batch size once and prints
one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import PROMPTS  # noqa: E402

SIZES = (1, 16)


def child(tokens: int) -> None:
    """One run: each batch size timed once after a warm-up; its ids and logprobs for comparing."""
    import lmtrace

    lm = lmtrace.load()
    settings = {"max_new_tokens": tokens, "temperature": 0, "top_logprobs": 5, "stop_on_eos": False}
    lmtrace.generate(lm, PROMPTS[0], **{**settings, "max_new_tokens": 4})
    out: dict = {"seconds": {}, "ids": {}, "logprobs": {}}
    for size in SIZES:
        prompts = PROMPTS[:size]
        started = time.perf_counter()
        traces = lmtrace.generate(lm, prompts if size > 1 else prompts[0], **settings)
        out["seconds"][size] = time.perf_counter() - started
        traces = traces if isinstance(traces, list) else [traces]
        out["ids"][size] = [t.token_ids for t in traces]
        out["logprobs"][size] = [[s.logprob for s in t.steps] for t in traces]
    print(json.dumps(out), flush=True)


def run_one(src: Path, args: argparse.Namespace) -> dict:
    """One child with `src` first on the path: its JSON line, or {"failed": why}."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tokens", str(args.tokens)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {args.timeout} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [""])[-1][:300]
        return {"failed": f"exit code {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def summary(runs: dict) -> dict:
    """Per batch size: each side's median seconds and tokens/s, and now's time over before's."""
    rows = {}
    for size in SIZES:
        key = str(size)
        medians = {}
        for side in ("before", "now"):
            times = [r["seconds"][key] for r in runs[side] if "seconds" in r]
            medians[side] = statistics.median(times) if times else None
        b, n = medians["before"], medians["now"]
        rows[key] = {"before_s": b, "now_s": n, "now_over_before": n / b if b and n else None}
    return rows


def agreement(runs: dict) -> str:
    """Whether the two sides gave the same ids, and their logprobs' largest difference."""
    before = next((r for r in runs["before"] if "ids" in r), None)
    now = next((r for r in runs["now"] if "ids" in r), None)
    if before is None or now is None:
        return "not compared (a side has no finished run)"
    same = all(before["ids"][k] == now["ids"][k] for k in before["ids"])
    gap = max(
        (
            abs(a - b)
            for k in before["logprobs"]
            for x, y in zip(before["logprobs"][k], now["logprobs"][k])
            for a, b in zip(x, y)
        ),
        default=0.0,
    )
    return f"token ids {'equal' if same else 'DIFFERENT'}; logprobs within {gap:.1e}"


def table(runs: dict, args: argparse.Namespace) -> str:
    lines = [
        f"bundled model, float32, greedy, {args.tokens} tokens (end ignored), top-5 logprobs, "
        f"{args.threads} thread(s), median of {args.rounds} rounds; before: {args.before}",
        "| batch | before s | now s | now / before |",
        "|---|---|---|---|",
    ]
    for size, row in summary(runs).items():
        b, n, ratio = row["before_s"], row["now_s"], row["now_over_before"]
        cells = [f"{b:.2f}" if b else "-", f"{n:.2f}" if n else "-", f"{ratio:.3f}" if ratio else "-"]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    lines.append(agreement(runs))
    failed = [f"{side}: {r['failed']}" for side in runs for r in runs[side] if "failed" in r]
    return "\n".join(lines + failed)


def write(runs: dict, args: argparse.Namespace) -> None:
    if args.json is None:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary(runs), "runs": runs}
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(args.json)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, help="a checkout (git worktree) of the commit to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each child (OMP_NUM_THREADS)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a child may take")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.tokens)
        return
    if args.before is None or not (args.before / "src" / "lmtrace").is_dir():
        raise SystemExit(f"--before: {args.before} is not a checkout of lmtrace (no src/lmtrace)")
    sources = {"before": args.before.resolve() / "src", "now": Path(__file__).resolve().parents[1] / "src"}
    runs: dict = {"before": [], "now": []}
    for r in range(args.rounds):
        for side in ("before", "now") if r % 2 == 0 else ("now", "before"):
            runs[side].append(run_one(sources[side], args))
            got = runs[side][-1]
            shown = got.get("failed") or ", ".join(f"batch {k}: {v:.2f} s" for k, v in got["seconds"].items())
            print(f"round {r + 1}: {side}: {shown}", flush=True)
            write(runs, args)
    print("\n" + table(runs, args))


if __name__ == "__main__":
    main()
