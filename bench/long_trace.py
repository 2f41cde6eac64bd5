"""Long traces' files (issue 53): a greedy trace of N tokens with ignore_eos (stop_on_eos=False),
written as `--json` (compact, save_json) and `--jsonl` (write_lines, as `lmtrace generate` writes
them), and measured: bytes per step of each file, the `--jsonl` file read back (Trace.from_json)
equal to the trace (to_dict), the peak RSS of the generation and, reset in between
(/proc/self/clear_refs 5), the peak RSS of the writing. With --inside the trace has lens and
attention, and its HTML report (render_html, as `lmtrace render --html`) is opened in headless
Chromium: bytes per step, time until the text is shown, time for a token's panel to open on click.

Each case runs in a child process of its own (a clean RSS): `bundled` (the bundled model, the
longest trace its context of 8,192 positions allows), `random` (a random-init model of the bundled
model's shape with max_position_embeddings 20,000, for 16,384 tokens: the records' sizes depend on
the shape, not on the weights), `inside` (the bundled model, lens and attention, 2,048 tokens) and
`synthetic` (no model: tests/long_trace.py's records of the bundled model's shape, 16,384 steps, for
the files and the report alone, in seconds). Every case writes its HTML report and opens it.
What was measured is written to --out (atomically) after each case, also where a case failed.
Usage: python bench/long_trace.py [--cases bundled,random,inside,synthetic] [--tokens-random 16384]
       [--tokens-inside 2048] [--out bench/results/long_trace.json] [--runs 3]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Think step by step, then answer: how many primes are there below 100?"
CONTEXT = 8192  # the bundled model's max_position_embeddings


def _status(key: str) -> int:
    """VmRSS / VmHWM of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _model(case: str):
    import lmtrace

    lm = lmtrace.load()
    if case != "random":
        return lm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**lm.model.config.to_dict(), "max_position_embeddings": 20000})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return lmtrace.LM.from_objects(model, lm.tokenizer, source="random-init SmolLM2-135M shape, context 20000")


def _write(trace, folder: Path) -> dict:
    from lmtrace.files import atomic_text
    from lmtrace.trace_file import save_json, write_lines

    json_path, jsonl_path = folder / "trace.json", folder / "trace.jsonl"
    began = time.perf_counter()
    save_json(json_path, trace)
    json_s = time.perf_counter() - began
    began = time.perf_counter()
    with atomic_text(jsonl_path) as out:
        write_lines(out, trace)
    jsonl_s = time.perf_counter() - began
    return {"json_path": json_path, "jsonl_path": jsonl_path, "json_write_s": json_s, "jsonl_write_s": jsonl_s}


def _read_back(trace, jsonl_path: Path, json_path: Path) -> dict:
    import lmtrace

    want = trace.to_dict()
    back = lmtrace.Trace.from_json(jsonl_path.read_text(encoding="utf-8")).to_dict()
    whole = lmtrace.Trace.from_json(json_path.read_text(encoding="utf-8")).to_dict()
    return {"jsonl_read_back_equal": back == want, "json_read_back_equal": whole == want}


def _browser(html_path: Path, steps: int, runs: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.test_report_browser import BROWSER, open_report

    if BROWSER is None:
        return {"browser": "no Chromium on this machine"}
    loads, clicks = [], []
    for run in range(runs):
        with tempfile.TemporaryDirectory() as profile:
            began = time.perf_counter()
            browser = open_report(html_path, Path(profile))
            try:
                browser.wait_for(f"document.querySelectorAll('.text .tok').length === {steps}", timeout=120)
                loads.append((time.perf_counter() - began) * 1000)
                i = (steps * 3) // 4 - run  # another step each run: no panel built before
                began = time.perf_counter()
                browser.js(f"(() => {{ document.querySelector('.text .tok[data-i=\"{i}\"]').click(); return 1; }})()")
                browser.wait_for(f"document.querySelector('#panel h3').textContent === 'step {i}'", timeout=60)
                clicks.append((time.perf_counter() - began) * 1000)
            finally:
                browser.close()
    return {
        "browser": BROWSER,
        "load_ms": loads,
        "click_ms": clicks,
        "load_ms_median": sorted(loads)[len(loads) // 2],
        "click_ms_median": sorted(clicks)[len(clicks) // 2],
    }


def _report(trace, folder: Path, runs: int) -> dict:
    """The trace's HTML report (as `lmtrace render --html`): its size, and in headless Chromium the
    time until its text is shown and until a token's panel opens on a click."""
    from lmtrace.render.html.trace import write_html

    html_path = folder / "report.html"
    write_html(str(html_path), trace)
    size = html_path.stat().st_size
    return {
        "html_bytes": size,
        "html_bytes_per_step": size / len(trace.steps),
        **_browser(html_path, len(trace.steps), runs),
    }


def run_case(case: str, tokens: int, runs: int) -> dict:
    """One case in this process: generate, then write, then read back (and the report)."""
    import torch

    import lmtrace

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lm = _model(case)
    prompt_len = len(lm.tokenizer(PROMPT)["input_ids"])
    if tokens <= 0:
        tokens = CONTEXT - prompt_len
    inside = case == "inside"
    result: dict = {"case": case, "tokens": tokens, "prompt_tokens": prompt_len, "lens": inside, "attention": inside}
    _reset_peak()
    before = _status("VmRSS")
    began = time.perf_counter()
    if case == "synthetic":  # the records alone, of the bundled model's shape (tests/long_trace.py)
        sys.path.insert(0, str(ROOT))
        from tests.long_trace import long_trace

        trace = long_trace(tokens, inside=False)
    else:
        trace = lmtrace.generate(
            lm, PROMPT, max_new_tokens=tokens, temperature=0, stop_on_eos=False, lens=inside, attention=inside
        )
    result["generate_s"] = time.perf_counter() - began
    result["steps"] = len(trace.steps)
    result["rss_before_generate"] = before
    result["rss_peak_generate"] = _status("VmHWM")
    _reset_peak()
    result["rss_before_write"] = _status("VmRSS")
    with tempfile.TemporaryDirectory(dir=os.environ.get("LONG_TRACE_TMP")) as folder:
        files = _write(trace, Path(folder))
        result["rss_peak_write"] = _status("VmHWM")
        result["write_to_generate_peak"] = result["rss_peak_write"] / result["rss_peak_generate"]
        for kind in ("json", "jsonl"):
            size = files[f"{kind}_path"].stat().st_size
            result[f"{kind}_bytes"] = size
            result[f"{kind}_bytes_per_step"] = size / len(trace.steps)
            result[f"{kind}_write_s"] = files[f"{kind}_write_s"]
        result.update(_read_back(trace, files["jsonl_path"], files["json_path"]))
        result.update(_report(trace, Path(folder), runs))
    return result


def _child(case: str, tokens: int, runs: int) -> dict:
    cmd = [sys.executable, __file__, "--child", case, "--tokens", str(tokens), "--runs", str(runs)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"case": case, "error": done.stderr[-4000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bundled,random,inside")
    ap.add_argument("--tokens-bundled", type=int, default=0, help="0: the context's positions less the prompt's")
    ap.add_argument("--tokens-random", type=int, default=16384)
    ap.add_argument("--tokens-inside", type=int, default=2048)
    ap.add_argument("--tokens-synthetic", type=int, default=16384)
    ap.add_argument("--runs", type=int, default=3, help="browser openings (load and click times)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_trace.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            print(json.dumps(run_case(args.child, args.tokens, args.runs)))
        except Exception:
            print(json.dumps({"case": args.child, "error": traceback.format_exc()[-4000:]}))
        return
    import torch
    import transformers

    from lmtrace.files import write_atomic

    record: dict = {
        "machine": f"{platform.processor() or platform.machine()} × {os.cpu_count()} cores",
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prompt": PROMPT,
        "cases": [],
    }
    tokens = {
        "bundled": args.tokens_bundled,
        "random": args.tokens_random,
        "inside": args.tokens_inside,
        "synthetic": args.tokens_synthetic,
    }
    for case in args.cases.split(","):
        began = time.perf_counter()
        result = _child(case, tokens[case], args.runs)
        result["case_s"] = time.perf_counter() - began
        record["cases"].append(result)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(record, indent=1) + "\n")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
