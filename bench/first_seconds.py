"""The first seconds a person waits: `lmtrace --help`, and `lmtrace generate "Hi"
--max-new-tokens 1` on the bundled model, each as a fresh process (wall clock and CPU seconds).

Contenders run interleaved over several rounds on the same machine:
  help            lmtrace --help (imports neither torch nor transformers)
  generate:cache  the GGUF's converted safetensors copy (warmed once before the rounds)
  generate:gguf   LMTRACE_GGUF_CACHE=0: transformers reads the GGUF itself (the old path)
With --before-src DIR (another checkout's src/, e.g. main before this change) the same commands
also run with that code first on the path ("before:help", "before:generate").

Medians and ratios are printed as a Markdown table and written to bench/results/first_seconds.json.
Usage: python bench/first_seconds.py [--rounds 3] [--before-src /path/to/src] [--no-gguf]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENTRY = "from lmtrace.cli import entry; entry()"
GENERATE = ["generate", "Hi", "--max-new-tokens", "1", "--temperature", "0", "--no-color"]


def run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", ENTRY, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv}: exit {done.returncode}: {done.stderr[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def contenders(before_src: str | None, gguf: bool) -> dict[str, tuple[list[str], dict[str, str]]]:
    env = {**os.environ, "LMTRACE_GGUF_CACHE": "1"}
    out = {"help": (["--help"], env), "generate:cache": (GENERATE, env)}
    if gguf:
        out["generate:gguf"] = (GENERATE, {**env, "LMTRACE_GGUF_CACHE": "0"})
    if before_src:
        old = {**env, "PYTHONPATH": str(Path(before_src).resolve())}
        out["before:help"] = (["--help"], old)
        out["before:generate"] = (GENERATE, old)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before-src", default=None, help="another checkout's src/ folder to compare with")
    parser.add_argument("--no-gguf", action="store_true", help="skip the uncached GGUF contender (slow)")
    args = parser.parse_args()
    runs = contenders(args.before_src, not args.no_gguf)
    run(GENERATE, runs["generate:cache"][1])  # warm: converts on a first run ever, then the file cache
    results: dict[str, dict[str, list[float]]] = {name: {"wall_s": [], "cpu_s": []} for name in runs}
    for _ in range(args.rounds):
        for name, (argv, env) in runs.items():
            wall, cpu = run(argv, env)
            results[name]["wall_s"].append(round(wall, 3))
            results[name]["cpu_s"].append(round(cpu, 3))
    medians = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    print(f"| contender | median wall s | median CPU s | rounds ({args.rounds}), wall s |")
    print("|---|---:|---:|---|")
    for name, r in results.items():
        print(f"| {name} | {medians[name]['wall_s']:.2f} | {medians[name]['cpu_s']:.2f} | {r['wall_s']} |")
    ratios = {}
    for slow, fast in (("generate:gguf", "generate:cache"), ("before:generate", "generate:cache"),
                       ("before:help", "help")):  # fmt: skip
        if slow in medians:
            ratios[f"{slow} / {fast}"] = round(medians[slow]["wall_s"] / medians[fast]["wall_s"], 2)
    for name, ratio in ratios.items():
        print(f"{name}: {ratio}x (median wall)")
    out = Path(__file__).parent / "results" / "first_seconds.json"
    out.parent.mkdir(exist_ok=True)
    record = {"machine": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
              "rounds": args.rounds, "results": results, "medians": medians, "ratios": ratios}  # fmt: skip
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
