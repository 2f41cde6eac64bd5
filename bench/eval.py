"""lm-evaluation-harness through `lmtrace serve` against the harness's own `hf` backend, on the
bundled model exported by `lmtrace export` (the same float32 weights), in one run:

- a local multiple-choice task (60 questions x 4 choices: 240 log-likelihood requests of 30-70
  tokens) and a rolling log-likelihood task (perplexity over 24 texts), each through the hf
  backend (`batch_size` 8, its model loaded inside the timed run) and through an already running
  `lmtrace serve` (`local-completions`, `tokenized_requests=True`, `batch_size` 8,
  `num_concurrent` 2) with its prefix cache on and off: wall time, requests/s, the ratio to the
  hf backend, the prefix cache's hit rate, and the largest difference between the per-sample
  log-likelihoods of the two backends;
- `lmtrace.score` on a list of 1,000 texts against a bare batched forward over the same tokens
  (the same batches, no numbers read).

Contenders alternate over `--runs` rounds; medians. Usage:
    python bench/eval.py [--runs 2] [--folder DIR] [--texts 1000] [--skip-eval] [--skip-score]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

NAMES = ["Ada", "Bram", "Chen", "Dina", "Emil", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena"]
PLACES = ["the harbour", "the old mill", "the market", "the library", "the station", "the orchard", "the bakery"]
THINGS = ["a blue lantern", "three apples", "a wooden box", "an old map", "a silver key", "a loaf of bread",
          "a broken clock", "a red umbrella", "two letters", "a jar of honey", "a small dog", "a violin"]  # fmt: skip
ACTS = ["walked to", "ran past", "waited at", "painted", "cleaned", "visited", "left", "returned to"]
TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
    "taught him. From the lamp room he could see the harbour, the fishing boats coming home, and the long grey "
    "line of the coast disappearing into the fog. "
)


def mc_docs(n: int = 60, seed: int = 0) -> list[dict]:
    """Questions whose context holds the answer among distractors: 4 choices each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        who, where = rng.choice(NAMES), rng.choice(PLACES)
        things = rng.sample(THINGS, 4)
        events = range(rng.randint(1, 5))
        story = " ".join(f"{rng.choice(NAMES)} {rng.choice(ACTS)} {rng.choice(PLACES)}." for _ in events)
        question = f"{story} In the morning {who} {rng.choice(ACTS)} {where} carrying {things[0]}.\nQuestion: What was {who} carrying?\nAnswer:"  # noqa: E501
        order = rng.sample(range(4), 4)
        docs.append({"question": question, "choices": [" " + things[i] for i in order], "answer": order.index(0)})
    return docs


def rolling_docs(n: int = 24, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    words = TEXT.split()
    return [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(60, 220)))} for _ in range(n)]


def write_tasks(where: Path, questions: int, texts: int) -> None:
    for name, docs, kind in [("bench_mc", mc_docs(questions), "mc"), ("bench_rolling", rolling_docs(texts), "rolling")]:
        (where / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {where}/{name}.jsonl\ntest_split: test\n"  # noqa: E501
        if kind == "mc":
            body = 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'  # noqa: E501
        else:
            body = 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'  # noqa: E501
        (where / f"{name}.yaml").write_text(head + body, encoding="utf-8")


def evaluate(task: str, tasks_dir: Path, model: str, model_args: dict) -> tuple[float, dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], batch_size=8, log_samples=True,
        task_manager=TaskManager(include_path=str(tasks_dir)),
    )  # fmt: skip
    return time.perf_counter() - started, out


def loglikelihoods(out: dict, task: str) -> list[float]:
    return [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for s in out["samples"][task] for r in s["resps"]]


def serve(folder: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, "-m", "lmtrace.cli", "serve", "--model", str(folder), "--port", str(port), *extra]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen([*cmd, "--served-model-name", "m"], env=env, **quiet)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("lmtrace serve did not start")


def metrics(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}


def server_args(port: int, folder: Path) -> dict:
    return {
        "model": "m", "base_url": f"http://127.0.0.1:{port}/v1/completions", "tokenizer": str(folder),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1,
    }  # fmt: skip


def run_eval(folder: Path, runs: int, tasks: list[str], questions: int = 60, docs: int = 24) -> list[dict]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tasks_dir = Path(tempfile.mkdtemp(prefix="lmtrace-bench-tasks-"))
    write_tasks(tasks_dir, questions, docs)
    ports = {"serve": 8711, "serve, prefix cache off": 8712}
    rows = []
    for task in tasks:
        times: dict[str, list[float]] = {"hf": [], **{k: [] for k in ports}}
        lls: dict[str, list[float]] = {}
        hits = [0.0, 0.0]
        for _ in range(runs):
            hf_args = {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}
            seconds, out = evaluate(task, tasks_dir, "hf", hf_args)
            times["hf"].append(seconds)
            lls["hf"], requests = loglikelihoods(out, task), len(loglikelihoods(out, task))
            # fresh servers each round (started before the clock): a round must not find the
            # previous round's prompts in the prefix cache
            procs = {name: serve(folder, port, *([] if name == "serve" else ["--prefix-cache-mb", "0"]))
                     for name, port in ports.items()}  # fmt: skip
            try:
                for name, port in ports.items():
                    before = metrics(port)
                    seconds, out = evaluate(task, tasks_dir, "local-completions", server_args(port, folder))
                    after = metrics(port)
                    times[name].append(seconds)
                    lls[name] = loglikelihoods(out, task)
                    if name == "serve":
                        key = "lmtrace_prefix_cache_{}_total"
                        hits[0] += after[key.format("hit_tokens")] - before[key.format("hit_tokens")]
                        hits[1] += after[key.format("queried_tokens")] - before[key.format("queried_tokens")]
            finally:
                for p in procs.values():
                    p.terminate()
                    p.wait(timeout=60)
        hf = statistics.median(times["hf"])
        for name, t in times.items():
            med = statistics.median(t)
            diff = max(abs(a - b) for a, b in zip(lls[name], lls["hf"]))
            rate = hits[0] / hits[1] if name == "serve" and hits[1] else None
            rows.append({"task": task, "backend": name, "seconds": med, "all": t, "requests_per_s": requests / med,
                         "ratio_to_hf": med / hf, "max_ll_diff_to_hf": diff, "prefix_hit_rate": rate})  # fmt: skip
    return rows


def texts_of(tokenizer, n: int, seed: int = 2) -> list[str]:
    rng = random.Random(seed)
    words = TEXT.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(10, 50))) for _ in range(n)]


def bare_forward(lm, texts: list[str], batch_size: int) -> None:
    """The floor: the same length-sorted batches, padded, forward only."""
    ids = [lm.tokenizer(t)["input_ids"] for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = [ids[i] for i in order[start : start + batch_size]]
            width = max(len(b) for b in batch)
            x = torch.full((len(batch), width), lm.pad_token_id)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, b in enumerate(batch):
                x[r, width - len(b) :], mask[r, width - len(b) :] = torch.tensor(b), 1
            lm.model(input_ids=x, attention_mask=mask, use_cache=False)


def run_score(n: int, runs: int) -> list[dict]:
    import lmtrace

    lm = lmtrace.load(dtype="float32")
    texts = texts_of(lm.tokenizer, n)
    tokens = sum(len(lm.tokenizer(t)["input_ids"]) for t in texts)
    contenders = {
        "bare batched forward": lambda: bare_forward(lm, texts, 8),
        "lmtrace.score(list), top_logprobs=5": lambda: lmtrace.score(lm, texts, top_logprobs=5),
        "lmtrace.score(list), top_logprobs=0": lambda: lmtrace.score(lm, texts, top_logprobs=0),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(runs):
        for name, fn in contenders.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    floor = statistics.median(times["bare batched forward"])
    return [{"contender": k, "texts": n, "tokens": tokens, "seconds": statistics.median(t), "all": t,
             "tokens_per_s": tokens / statistics.median(t), "ratio_to_bare": statistics.median(t) / floor}
            for k, t in times.items()]  # fmt: skip


def export(folder: Path | None) -> Path:
    if folder is not None and (folder / "config.json").exists():
        return folder
    folder = folder or Path(tempfile.mkdtemp(prefix="lmtrace-bench-model-")) / "smollm2"
    env = {**os.environ, "PYTHONPATH": SRC}
    subprocess.run([sys.executable, "-m", "lmtrace.cli", "export", str(folder)], check=True, env=env)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--folder", type=Path, default=None, help="lmtrace export's folder (made when missing)")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=60, help="of the multiple-choice task (4 choices each)")
    ap.add_argument("--docs", type=int, default=24, help="of the rolling task")
    ap.add_argument("--task", action="append", choices=["bench_mc", "bench_rolling"], help="default: both")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--skip-score", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of every contender (servers too)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, runs {args.runs}")
    figures: dict[str, list] = {}
    if not args.skip_eval:
        tasks = args.task or ["bench_mc", "bench_rolling"]
        figures["eval"] = run_eval(export(args.folder), args.runs, tasks, args.questions, args.docs)
        print("| task | backend | median s | req/s | ratio to hf | max ll diff | prefix hit rate |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in figures["eval"]:
            rate = "" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.0%}"
            print(f"| {r['task']} | {r['backend']} | {r['seconds']:.1f} | {r['requests_per_s']:.1f} | "
                  f"{r['ratio_to_hf']:.2f} | {r['max_ll_diff_to_hf']:.1e} | {rate} |")  # fmt: skip
    if not args.skip_score:
        figures["score"] = run_score(args.texts, args.runs)
        print("| contender | texts | tokens | median s | tok/s | ratio to bare |\n|---|---:|---:|---:|---:|---:|")
        for r in figures["score"]:
            print(f"| {r['contender']} | {r['texts']} | {r['tokens']} | {r['seconds']:.1f} | "
                  f"{r['tokens_per_s']:.0f} | {r['ratio_to_bare']:.2f} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
