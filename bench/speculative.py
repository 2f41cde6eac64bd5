"""Speculative decoding against plain float32 decoding on the bundled model (batch 1, greedy):
lmtrace float32 plain, the packed 4-bit path alone (eager and --compile), float32 with the packed
draft at K = 2, 4, 6 (and with the draft's step compiled at K = 4, 6) and with the
self-speculative `layers:N` draft; then the fast path, `--matmul onednn` (its verify forward of K + 1
rows costs about one row's), plain and with the packed draft at K = 3, 4, 5 and auto, and at auto with
the draft's step compiled (`--compile`: only the packed draft compiles, the target keeps oneDNN);
and `--matmul onednn-fused` (the small operations in C too), plain and with the packed draft at
K = 4 and auto (and auto compiled). One run, the contenders interleaved in every round (each on
the same prompts), medians over rounds; tokens/s, the ratio to plain float32,
acceptance by position, and whether every run gave plain float32's tokens.

The contenders run in a child process that loads the models once; a contender that crashes it
(or raises) is that contender's result for that run, the child is started again, and the others
go on. The JSON is written after every run, so a run cut short keeps what it measured.

Usage: python bench/speculative.py [--rounds 3] [--tokens 64] [--prompts 2] [--layers 8]
       [--model PATH.gguf] [--out FILE.json] [--only onednn,layers] [--skip compile]
       [--crash NAME (a check: the child aborts there)]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "The three most important ideas in physics are",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "A good cup of coffee needs",
]
PLAIN, PACKED, ONEDNN = "float32 plain", "packed alone", "float32 --matmul onednn plain"
FUSED = "float32 --matmul onednn-fused plain"


def contenders(layers: int) -> dict[str, dict]:
    """name -> how the child runs it: which model, which draft, how many tokens a block."""
    out = {PLAIN: {"lm": "float32"}, f"{PACKED}, MLP not fused (as before)": {"lm": "packed-apart"},
           PACKED: {"lm": "packed"}, f"{PACKED} --compile": {"lm": "packed", "compile": True}}  # fmt: skip
    for k in (2, 4, 6):
        out[f"float32 + packed draft K={k}"] = {"lm": "float32", "draft": "packed", "k": k}
    for k in (4, 6):
        out[f"float32 + packed draft K={k} --compile"] = {"lm": "float32", "draft": "packed", "k": k, "compile": True}
    out[f"float32 + layers:{layers} K=4"] = {"lm": "float32", "draft": f"layers:{layers}", "k": 4}
    out[ONEDNN] = {"lm": "onednn"}  # the fast path: verify rows in one oneDNN forward
    for k in (3, 4, 5, "auto"):
        out[f"onednn + packed draft K={k}"] = {"lm": "onednn", "draft": "packed", "k": k}
    out["onednn + packed draft K=auto --compile"] = {"lm": "onednn", "draft": "packed", "k": "auto", "compile": True}
    out["float32 + packed draft K=auto"] = {"lm": "float32", "draft": "packed", "k": "auto"}
    out[FUSED] = {"lm": "onednn-fused"}  # oneDNN's products, the small operations in C
    for k in (4, "auto"):
        out[f"onednn-fused + packed draft K={k}"] = {"lm": "onednn-fused", "draft": "packed", "k": k}
    out["onednn-fused + packed draft K=auto --compile"] = {
        "lm": "onednn-fused",
        "draft": "packed",
        "k": "auto",
        "compile": True,
    }
    return out


# --- the child: loads the models once, runs one contender per line of standard input ---


def worker(model: str | None, tokens: int, crash: str | None) -> None:
    import torch

    import lmtrace
    from lmtrace.model.gguf.packed import pack_gguf
    from lmtrace.model.load import bundled_gguf

    lms = {"float32": lmtrace.load(model, device="cpu", dtype="float32"),
           "packed": lmtrace.load(model, device="cpu", dtype="float32", weights="packed"),
           "packed-apart": lmtrace.load(model, device="cpu", dtype="float32"),
           "onednn": lmtrace.load(model, device="cpu", dtype="float32", matmul="onednn"),
           "onednn-fused": lmtrace.load(model, device="cpu", dtype="float32", matmul="onednn-fused")}  # fmt: skip
    pack_gguf(lms["packed-apart"].model, model or bundled_gguf(), fuse=False)  # the packed path before fusion
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        task = json.loads(line)
        how = task["how"]
        if task["name"] == crash:
            os.abort()  # the check that the bench survives a crashing contender
        lm = lms[how["lm"]]
        extra = {"draft": how["draft"], "draft_tokens": how["k"]} if "draft" in how else {}
        extra["compile"] = how.get("compile", False)
        if task.get("warm"):  # the draft's load, a compile and the first forwards are not timed
            lmtrace.generate(lm, task["prompt"], max_new_tokens=tokens, temperature=0, stop_on_eos=False, **extra)
        started = time.perf_counter()
        trace = lmtrace.generate(lm, task["prompt"], max_new_tokens=tokens, temperature=0, top_logprobs=5,
                                 stop_on_eos=False, **extra)  # fmt: skip
        seconds = time.perf_counter() - started
        print(json.dumps({"tokens": len(trace.steps), "seconds": seconds, "token_ids": trace.token_ids,
                          "speculative": trace.speculative}), flush=True)  # fmt: skip


# --- the parent: plans the interleaved runs, keeps a child going, writes what it measured ---


class Child:
    def __init__(self, args: argparse.Namespace):
        command = [sys.executable, __file__, "--worker", "--tokens", str(args.tokens)]
        command += ["--model", args.model] if args.model else []
        command += ["--crash", args.crash] if args.crash else []
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the child could not load the models (exit code {self.proc.wait()})")

    def run(self, task: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(task) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if line:
            return json.loads(line)
        code = self.proc.wait()
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise RuntimeError(f"crashed ({why})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def summarize(record: dict) -> None:
    """Medians, ratios to plain float32, acceptance by position (mean over runs), identical tokens."""
    for r in record["results"].values():
        r["median"] = statistics.median(r["tok_s"]) if r["tok_s"] else None
    plain = record["results"].get(PLAIN, {}).get("median")
    fast = record["results"].get(ONEDNN, {}).get("median")
    for r in record["results"].values():
        r["ratio_to_plain"] = r["median"] / plain if r["median"] and plain else None
        r["ratio_to_onednn"] = r["median"] / fast if r["median"] and fast else None
        rates = [s["acceptance_by_position"] for s in r["speculative"] if s]
        by_position = [  # auto's runs propose blocks of different lengths
            [x[j] for x in rates if j < len(x) and x[j] is not None] for j in range(max(map(len, rates), default=0))
        ]
        r["acceptance_by_position"] = [statistics.mean(p) if p else None for p in by_position] or None
        means = [s["mean_accepted_per_block"] for s in r["speculative"] if s and s["mean_accepted_per_block"]]
        r["mean_accepted_per_block"] = statistics.mean(means) if means else None


def table(record: dict) -> str:
    lines = ["| contender | median tok/s | runs | ratio to float32 plain | ratio to onednn plain | tokens identical | "
             "acceptance by position | accepted per block |", "|---|---:|---:|---:|---:|:---:|---|---:|"]  # fmt: skip
    for name, r in record["results"].items():
        med = f"{r['median']:.1f}" if r.get("median") else "failed"
        ratio = f"{r['ratio_to_plain']:.2f}" if r.get("ratio_to_plain") else "—"
        fast = f"{r['ratio_to_onednn']:.2f}" if r.get("ratio_to_onednn") else "—"
        same = "—" if "draft" not in r["how"] else ("yes" if r["identical"] and all(r["identical"]) else "no")
        acc = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"]) if r.get("acceptance_by_position") else "—"
        per = f"{r['mean_accepted_per_block']:.2f}" if r.get("mean_accepted_per_block") else "—"
        lines.append(f"| {name} | {med} | {len(r['tok_s'])} | {ratio} | {fast} | {same} | {acc} | {per} |")
    for name, errors in record["errors"].items():
        lines.append(f"\n{name}: " + "; ".join(errors))
    return "\n".join(lines)


def run(args: argparse.Namespace, record: dict, out: Path) -> None:
    plan = contenders(args.layers)
    if args.only:  # the float32 plain reference always runs: the tokens are checked against it
        words = args.only.split(",")
        plan = {n: h for n, h in plan.items() if n in (PLAIN, ONEDNN, FUSED) or any(w in n for w in words)}
    if args.skip:  # e.g. --skip compile: the compiled drafts' warm-ups take minutes a prompt
        plan = {n: h for n, h in plan.items() if n == PLAIN or not any(w in n for w in args.skip.split(","))}
    record["results"] = {n: {"tok_s": [], "identical": [], "speculative": [], "how": how} for n, how in plan.items()}
    child, warmed = None, set()
    for rnd in range(args.rounds):
        for prompt in PROMPTS[: args.prompts]:
            reference = None
            for name, how in plan.items():  # interleaved: every contender on this prompt, then the next
                # a compiled step's graph is made per cache length: warmed on every prompt
                key = (name, prompt) if how.get("compile") else name
                task = {"name": name, "how": how, "prompt": prompt, "warm": key not in warmed}
                try:
                    child = child or Child(args)
                    got = child.run(task)
                except Exception as e:  # noqa: BLE001 - the contender's result is its failure
                    record["errors"].setdefault(name, []).append(f"round {rnd}: {' '.join(str(e).split())[:200]}")
                    child = None
                    continue
                warmed.add(key)
                r = record["results"][name]
                r["tok_s"].append(got["tokens"] / got["seconds"])
                r["speculative"].append(got["speculative"])
                if name == PLAIN:
                    reference = got["token_ids"]
                elif reference is not None and "draft" in how:
                    r["identical"].append(got["token_ids"] == reference)
                summarize(record)
                write(out, record)
    if child is not None:
        child.close()


def write(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2, help=f"prompts per round (1-{len(PROMPTS)})")
    ap.add_argument("--layers", type=int, default=8, help="N of the self-speculative layers:N draft")
    ap.add_argument("--model", default=None, help="a .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/speculative-<time>.json)")
    ap.add_argument("--only", default=None, help="contenders whose names hold one of these comma-separated words")
    ap.add_argument("--skip", default=None, help="leave out contenders whose names hold one of these words")
    ap.add_argument("--crash", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    if args.worker:
        worker(args.model, args.tokens, args.crash)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still writes what was measured
    out = Path(args.out or f"bench/results/speculative-{time.strftime('%Y%m%d-%H%M%S')}.json")
    record = {"machine": {"platform": platform.platform(), "cores": os.cpu_count(), "load": os.getloadavg()},
              "model": args.model or "bundled SmolLM2-135M-Instruct", "tokens": args.tokens, "rounds": args.rounds,
              "prompts": PROMPTS[: args.prompts], "results": {}, "errors": {}}  # fmt: skip
    try:
        run(args, record, out)
    except BaseException as e:  # noqa: BLE001 - whatever happens, what was measured is written
        record["errors"]["run"] = [" ".join(str(e).split())[:300] or type(e).__name__]
        raise
    finally:
        record["machine"]["load_after"] = os.getloadavg()
        print(f"{record['model']}, CPU, batch 1, greedy, {args.tokens} new tokens, {args.rounds} rounds\n")
        print(table(record))
        write(out, record)
        print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
