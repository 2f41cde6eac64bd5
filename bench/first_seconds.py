"""The first seconds a person waits, each as a fresh process (wall clock), on the bundled model:

  help             lmtrace --help (imports neither torch nor transformers)
  first line       generate "Hi" --max-new-tokens 1: seconds until the first line on stderr
  generate         the same command to its end (the GGUF's converted copy, warmed once before)
  error:NAME       bad input that must be answered before torch (< 1 s): a binary, a missing or an
                   empty prompt, a missing model path, a hub id missing from the local cache offline
  server:first     generate --server URL against a warm `lmtrace serve`: seconds from the process's
                   start until the first streamed step arrives (the client imports no torch)
  server:generate  that command to its end (8 tokens)
  generate:gguf    with --gguf: LMTRACE_GGUF_CACHE=0, transformers reads the GGUF itself (the old path)

Contenders run interleaved over several rounds. With --before-src DIR (another checkout's src/,
e.g. main before this change) help, first line, generate and the errors also run with that code
("before:..."). --no-server skips the server (it loads the model once more).
Medians and ratios are printed as a Markdown table and written to bench/results/first_seconds.json.
Usage: python bench/first_seconds.py [--rounds 3] [--before-src /path/to/src] [--no-server] [--gguf]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENTRY = "from lmtrace.cli import entry; entry()"
GENERATE = ["generate", "Hi", "--max-new-tokens", "1", "--temperature", "0", "--no-color"]
# the client's own process: the seconds until the first streamed step, from before the interpreter starts
FIRST_STEP = """
import sys, time
from lmtrace.cli import remote
from lmtrace.params import SamplingParams
seen = []
remote.trace(sys.argv[1], None, "Hi", SamplingParams(max_new_tokens=8, temperature=0), False, {},
             lambda step: seen.append(time.time()))
print(seen[0])
"""


def errors(tmp: Path) -> dict[str, list[str]]:
    binary = tmp / "binary.txt"
    binary.write_bytes(b"Hello \xd0\xff\xfe\x00")
    empty = tmp / "empty.txt"
    empty.write_text("")
    return {
        "binary prompt file": ["generate", "--prompt-file", str(binary)],
        "missing prompt file": ["generate", "--prompt-file", str(tmp / "none.txt")],
        "empty prompt": ["generate", "--prompt-file", str(empty)],
        "missing model path": ["generate", "Hi", "--model", str(tmp / "no-model")],
        "uncached hub id": ["generate", "Hi", "--model", "someone/not-cached"],
    }


def wall(argv: list[str], env: dict[str, str], code: int | None = 0) -> float:
    """Seconds of one fresh process; `code` the exit it must give (None: any, for the code before)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", ENTRY, *argv], env=env, capture_output=True, text=True)
    if code is not None and done.returncode != code:
        raise SystemExit(f"{argv}: exit {done.returncode}, expected {code}: {done.stderr[-500:]}")
    return time.perf_counter() - started


def first_line(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds until the first line on stderr, seconds until the end)."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", ENTRY, *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    first = None
    for line in proc.stderr:
        if first is None and line.strip():
            first = time.perf_counter() - started
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{argv}: exit {proc.returncode}")
    return first if first is not None else float("nan"), time.perf_counter() - started


def start_server(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", ENTRY, "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("lmtrace serve did not start")


def server_rounds(env: dict[str, str], rounds: int, results: dict[str, list[float]]) -> None:
    proc, url = start_server(env)
    try:
        wall(["generate", "Hi", "--server", url, "--max-new-tokens", "8"], env)  # warm: the first request
        for _ in range(rounds):
            started = time.time()
            done = subprocess.run([sys.executable, "-c", FIRST_STEP, url], env=env, capture_output=True, text=True)
            results.setdefault("server:first", []).append(round(float(done.stdout.strip()) - started, 3))
            cli = wall(["generate", "Hi", "--server", url, "--max-new-tokens", "8", "--no-color"], env)
            results.setdefault("server:generate", []).append(round(cli, 3))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def local_rounds(env: dict[str, str], prefix: str, tmp: Path, results: dict[str, list[float]]) -> None:
    results.setdefault(f"{prefix}help", []).append(round(wall(["--help"], env), 3))
    first, whole = first_line(GENERATE, env)
    results.setdefault(f"{prefix}first line", []).append(round(first, 3))
    results.setdefault(f"{prefix}generate", []).append(round(whole, 3))
    for name, argv in errors(tmp).items():
        seconds = wall(argv, env, code=None if prefix else 2)
        results.setdefault(f"{prefix}error:{name}", []).append(round(seconds, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before-src", default=None, help="another checkout's src/ folder to compare with")
    parser.add_argument("--no-server", action="store_true", help="skip the server contenders")
    parser.add_argument("--gguf", action="store_true", help="also generate with the GGUF read itself (slow)")
    args = parser.parse_args()
    env = {**os.environ, "LMTRACE_GGUF_CACHE": "1"}  # HF_HUB_OFFLINE unset: the old code retried the hub 30 s
    envs = {"": env}
    if args.before_src:
        envs["before:"] = {**env, "PYTHONPATH": str(Path(args.before_src).resolve())}
    first_line(GENERATE, env)  # warm: converts on a first run ever, then the file cache
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for prefix, e in envs.items():
                local_rounds(e, prefix, Path(tmp), results)
            if args.gguf:
                gguf = wall(GENERATE, {**env, "LMTRACE_GGUF_CACHE": "0"})
                results.setdefault("generate:gguf", []).append(round(gguf, 3))
    if not args.no_server:
        server_rounds(env, args.rounds, results)
    medians = {name: statistics.median(v) for name, v in results.items()}
    print(f"| contender | median wall s | rounds ({args.rounds}), wall s |")
    print("|---|---:|---|")
    for name, values in results.items():
        print(f"| {name} | {medians[name]:.2f} | {values} |")
    ratios = {f"before:{k} / {k}": round(medians[f"before:{k}"] / medians[k], 1)
              for k in medians if f"before:{k}" in medians and medians[k] > 0}  # fmt: skip
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
