"""Side-by-side decoding speed on the bundled model, one process, contenders interleaved in every
round, medians over rounds: transformers' model.generate (plain, and with output_scores +
output_logits), lmtrace.generate in float32, bfloat16, with the GGUF's packed 4-bit weights and
with --compile, with --matmul onednn (and onednn-fused), with --matmul onednn-fused and the packed
draft (speculative, K auto, batch 1) (with --inside also the logit lens, attention over the cache,
and both), and
llama-cpp-python (plain and with logprobs, each in a child process that may crash: the crash is
that contender's result; built by `make bench-deps`, bench/llama_python.py). Batch sizes 1 and 16 by default.

Each figure is also a fraction of its own bandwidth bound: batch x read bandwidth / bytes of
weights read per token in that contender's weight format (bench/bandwidth.py probes the
bandwidth with all threads, the best of several methods; a figure above 100% is flagged as a
probe error). The fidelity of bfloat16 and packed against float32 (greedy on the bench prompts,
teacher-forced float32 reference) and each exact path's |Δ| to the default float32 path (onednn,
speculative, compile: the same tokens, logprobs within 5e-5) close the run. The table is printed and written as JSON
even when a contender fails.

A contender is a small function (Bench, batch) -> Contender | str (a reason to skip it); add one
to CONTENDERS to time something new.
--model FILE runs another GGUF file (e.g. a Q4_K_M one) in place of the bundled model.
Usage: python bench/decode.py [--model FILE] [--rounds 3] [--tokens 64] [--batch-sizes 1,16] [--no-compile]
       [--inside]
With --device (cuda, or cpu to check the script), random-weight models of DeepSeek-R1-Distill-Qwen's
shapes instead, batch 1: bench/decode_shapes.py (--shapes 1.5b,7b --tokens 128 --bandwidth 4.8e12)."""

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bandwidth  # noqa: E402
from llama_python import HOW, llama_python  # noqa: E402

import lmtrace  # noqa: E402
from lmtrace.versions import versions  # noqa: E402

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important ideas in physics are",
    "Write a short poem about the moon:",
    "很久很久以前，",
    "def fibonacci(n):",
    "The capital of France is",
    "In 1969, the first humans",
    "A good cup of coffee needs",
]
WORKER = Path(__file__).resolve().parent / "llama_cpp_worker.py"


class Failed(Exception):
    """A contender that could not run (its message is the recorded result)."""


@dataclass
class Contender:
    name: str
    weights: str  # the key of Bench.step_bytes: which weight format it reads per token
    run: Callable[[list[str]], int | tuple[int, float]]  # tokens, or (tokens, seconds it timed itself)


@dataclass
class Bench:
    """What the contenders share: the models (loaded once), the run's settings."""

    tokens: int
    compile: bool
    lm: lmtrace.LM
    model: Path | None = None  # --model FILE: a GGUF file instead of the bundled one
    inside: bool = False
    bf16: lmtrace.LM | None = None
    onednn: lmtrace.LM | None = None  # float32, its linear layers on oneDNN (--matmul onednn)
    fused: lmtrace.LM | None = None  # and the layers' small operations in C (--matmul onednn-fused)
    packed: lmtrace.LM | None = None
    packed_torch: lmtrace.LM | None = None  # the same file on torch's bfloat16 int4 kernel
    step_bytes: dict[str, int] = field(default_factory=dict)


def weights_read_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer (packed or float) and the norms;
    the input embedding only where it is also the lm_head (a lookup reads one row)."""
    from lmtrace.model.gguf.packed import PackedLinear

    embed = getattr(model.get_input_embeddings(), "weight", None)  # a PackedEmbedding has none: rows from the file
    seen, total = ({embed.data_ptr()} if embed is not None else set()), 0
    for module in model.modules():
        tensors = [module.packed, module.scale_zeros] if isinstance(module, PackedLinear) else []
        tensors += list(module.parameters(recurse=False))
        for t in tensors:
            if t.data_ptr() not in seen or (t is embed and isinstance(module, torch.nn.Linear)):
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def gguf_bytes(path: Path) -> int:
    """Bytes of all tensors in the GGUF file: what llama.cpp reads per token (tied lm_head)."""
    from lmtrace.model.gguf.tensors import GGUFTensors

    return sum(int(t.n_bytes) for t in GGUFTensors(path).tensors)


def hf_generate(lm, prompts: list[str], n: int, scores: bool) -> int:
    lm.tokenizer.padding_side = "left"
    if lm.tokenizer.pad_token_id is None:
        lm.tokenizer.pad_token_id = lm.pad_token_id
    enc = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    extra = {"output_scores": True, "output_logits": True, "return_dict_in_generate": True} if scores else {}
    out = lm.model.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n, top_k=None, top_p=None,
                            pad_token_id=lm.pad_token_id, **extra)  # fmt: skip
    seq = out.sequences if scores else out
    return (seq.shape[1] - enc["input_ids"].shape[1]) * len(prompts)


def traced(lm, prompts: list[str], n: int, compile: bool = False, **extra: Any) -> int:
    traces = lmtrace.generate(lm, prompts, max_new_tokens=n, temperature=0, top_logprobs=20, stop_on_eos=False,
                              compile=compile, **extra)  # fmt: skip
    return sum(len(t.steps) for t in traces)


def gguf_file(model: Path | None) -> Path:
    """The GGUF file the bench runs: --model, else the bundled one."""
    return model if model is not None else lmtrace.model.load.bundled_gguf()


def llama_cpp_run(n: int, logprobs: int, model: Path | None = None) -> Callable[[list[str]], tuple[int, float]]:
    """One child process per timed run: it loads the file, warms up, and times one completion."""

    def run(prompts: list[str]) -> tuple[int, float]:
        args = [llama_python(), str(WORKER), str(gguf_file(model)), prompts[0], str(n),
                str(torch.get_num_threads()), str(logprobs)]  # fmt: skip
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as e:
            raise Failed("timed out after 600 s") from e
        if done.returncode == 3:
            raise Failed(HOW)
        if done.returncode < 0:
            tail = " ".join(done.stderr.split())[-200:]
            raise Failed(f"crashed: {signal.Signals(-done.returncode).name}" + (f" ({tail})" if tail else ""))
        if done.returncode != 0:
            raise Failed(f"exit code {done.returncode}: {' '.join(done.stderr.split())[-200:]}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return found["tokens"], found["seconds"]

    return run


# --- the contenders: (Bench, batch) -> Contender, or a string saying why it is skipped ---


def c_generate(b: Bench, batch: int) -> Contender:
    return Contender("model.generate", "float32", lambda p: hf_generate(b.lm, p, b.tokens, False))


def c_generate_scores(b: Bench, batch: int) -> Contender:
    return Contender("model.generate + output_scores/logits", "float32", lambda p: hf_generate(b.lm, p, b.tokens, True))


def c_float32(b: Bench, batch: int) -> Contender:
    return Contender("lmtrace float32 (top_logprobs=20, KV ledger)", "float32", lambda p: traced(b.lm, p, b.tokens))


def c_bfloat16(b: Bench, batch: int) -> Contender | str:
    if b.bf16 is None:
        return "bfloat16 model not loaded"
    return Contender("lmtrace bfloat16", "bfloat16", lambda p: traced(b.bf16, p, b.tokens))


def c_onednn(b: Bench, batch: int) -> Contender | str:
    if b.onednn is None:
        return "--no-onednn"
    return Contender("lmtrace float32 --matmul onednn", "float32", lambda p: traced(b.onednn, p, b.tokens))


def c_fused(b: Bench, batch: int) -> Contender | str:
    if b.fused is None:
        return "--no-fused"
    return Contender("lmtrace float32 --matmul onednn-fused", "float32", lambda p: traced(b.fused, p, b.tokens))


def c_packed(b: Bench, batch: int) -> Contender | str:
    if b.packed is None:
        return "packed model not loaded"
    return Contender("lmtrace packed 4-bit (--weights packed)", "packed", lambda p: traced(b.packed, p, b.tokens))


def c_packed_torch(b: Bench, batch: int) -> Contender | str:
    if b.packed_torch is None:
        return "--no-packed-torch, or no C compiler (packed is torch's kernel already)"
    name = "lmtrace packed 4-bit, torch's bfloat16 int4 kernel (as without a C compiler)"
    return Contender(name, "packed-torch", lambda p: traced(b.packed_torch, p, b.tokens))


def c_packed_compiled(b: Bench, batch: int) -> Contender | str:
    if b.packed is None or not b.compile:
        return "packed model not loaded" if b.packed is None else "--no-compile"
    if b.packed_torch is None:
        return "no C compiler: packed runs torch's kernel, which --compile refuses"
    name = "lmtrace packed 4-bit --compile (lmtrace's kernel one op in the graph)"
    return Contender(name, "packed", lambda p: traced(b.packed, p, b.tokens, compile=True))


def c_compile(b: Bench, batch: int) -> Contender | str:
    if not b.compile:
        return "--no-compile"
    return Contender("lmtrace float32 --compile", "float32", lambda p: traced(b.lm, p, b.tokens, compile=True))


# inside each step (lmtrace.inside.lens, lmtrace.inside.attention), against the plain float32 traced contender
INSIDE = {"lens": {"lens": True}, "attention": {"attention": True},
          "lens + attention": {"lens": True, "attention": True}}  # fmt: skip
PLAIN = "lmtrace float32 (top_logprobs=20, KV ledger)"
SPECULATIVE = "lmtrace float32 --matmul onednn-fused + packed draft (--draft-tokens auto)"
DRAFT = {"draft": "packed", "draft_tokens": "auto"}


def _inside(key: str) -> Callable[[Bench, int], Contender | str]:
    def make(b: Bench, batch: int) -> Contender | str:
        if not b.inside:
            return "no --inside"
        return Contender(f"lmtrace float32 + {key}", "float32", lambda p: traced(b.lm, p, b.tokens, **INSIDE[key]))

    make.__name__ = f"c_{key.replace(' + ', '_')}"
    return make


def json_bytes_per_step(lm, n: int) -> dict[str, dict[str, float]]:
    """The trace JSON's size per step, plain and with each inside option, at top_logprobs 5 and 20."""
    out = {}
    for top in (5, 20):
        for name, kw in {"plain": {}, **INSIDE}.items():
            t = lmtrace.generate(lm, PROMPTS[0], max_new_tokens=n, temperature=0, top_logprobs=top, stop_on_eos=False,
                                 **kw)  # fmt: skip
            out.setdefault(f"top_logprobs={top}", {})[name] = len(t.to_json().encode()) / len(t.steps)
    return out


def inside_summary(record: dict, batch_sizes: list[int], sizes: dict) -> dict:
    """Step time of each inside option over the plain traced one (the goal: lens + attention <= 1.5x)."""
    ratios = {}
    for batch in batch_sizes:
        plain = record["results"].get(f"{PLAIN} @ batch {batch}", {}).get("median")
        for k in INSIDE:
            rate = record["results"].get(f"lmtrace float32 + {k} @ batch {batch}", {}).get("median")
            if plain and rate:
                ratios[f"{k} @ batch {batch}"] = plain / rate
    return {"step_time_ratio": ratios, "json_bytes_per_step": sizes}


def c_speculative(b: Bench, batch: int) -> Contender | str:
    """The fastest lossless setting: verify on oneDNN with the small operations in C, the packed
    draft's steps eager on lmtrace's kernel (a compiled draft step is slower since its layers run in
    two C calls: bench/speculative.py)."""
    if batch != 1:
        return "batch 1 only (a batch of prompts decodes speculatively one prompt after another)"
    if b.fused is None:
        return "--no-fused"
    return Contender(SPECULATIVE, "float32", lambda p: traced(b.fused, p, b.tokens, **DRAFT))


def exact_paths(bench: Bench, n: int) -> dict[str, dict]:
    """Each exact path against the default float32 path, greedy on the first four bench prompts:
    whether every token is the same, and the largest |Δ| of a chosen token's logprob (up to the
    first token that differs, where there is one)."""
    kw = {"max_new_tokens": n, "temperature": 0, "top_logprobs": 5, "stop_on_eos": False}
    paths = {"--matmul onednn": (bench.onednn, {}), "--matmul onednn-fused": (bench.fused, {})}
    paths[SPECULATIVE] = (bench.fused, DRAFT)
    paths["--compile"] = (bench.lm, {"compile": True}) if bench.compile else (None, {})
    if bench.packed_torch is not None:  # packed on lmtrace's kernel: the float32 model of the same file
        paths["--weights packed"] = (bench.packed, {})
        paths["--weights packed --compile"] = (bench.packed, {"compile": True}) if bench.compile else (None, {})
    found = {}
    for name, (lm, extra) in paths.items():
        if lm is None:
            continue
        same, worst = True, 0.0
        for prompt in PROMPTS[:4]:
            base = lmtrace.generate(bench.lm, prompt, **kw)
            got = lmtrace.generate(lm, prompt, **kw, **extra)
            same = same and got.token_ids == base.token_ids
            for a, b in zip(got.steps, base.steps):
                worst = max(worst, abs(a.logprob - b.logprob))
                if a.token_id != b.token_id:
                    break
        found[name] = {"tokens_identical": same, "max_abs_logprob_diff": worst}
    return found


def c_llama_cpp(b: Bench, batch: int) -> Contender | str:
    if batch != 1:
        return "batch 1 only"
    return Contender("llama-cpp-python (plain)", "gguf", llama_cpp_run(b.tokens, 0, b.model))


def c_llama_cpp_logprobs(b: Bench, batch: int) -> Contender | str:
    if batch != 1:
        return "batch 1 only"
    return Contender("llama-cpp-python (logprobs=5)", "gguf", llama_cpp_run(b.tokens, 5, b.model))


CONTENDERS = [
    c_generate,
    c_generate_scores,
    c_float32,
    c_onednn,
    c_fused,
    c_speculative,
    c_bfloat16,
    c_packed,
    c_packed_torch,
    c_packed_compiled,
    c_compile,
    *map(_inside, INSIDE),
    c_llama_cpp,
    c_llama_cpp_logprobs,
]


def measure(bench: Bench, batch: int, rounds: int, errors: dict[str, str]) -> dict[str, dict]:
    """Warm-up (the one-off compile or prepack shows there), then `rounds` rounds that run every
    contender once each, in turn. A contender that raises is dropped and its error recorded."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    runs: dict[str, Contender] = {}
    for make in CONTENDERS:
        found = make(bench, batch)
        if isinstance(found, str):
            errors[f"{make.__name__} @ batch {batch}"] = f"skipped: {found}"
        else:
            runs[found.name] = found
    results = {name: {"weights": c.weights, "runs": [], "first_run_s": None} for name, c in runs.items()}
    for name, c in list(runs.items()):
        try:
            start = time.perf_counter()
            c.run(prompts)
            results[name]["first_run_s"] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - any failure is this contender's result
            results[name]["error"] = _one_line(e)
            del runs[name]
    for _ in range(rounds):
        for name, c in list(runs.items()):
            try:
                start = time.perf_counter()
                got = c.run(prompts)
                tokens, seconds = got if isinstance(got, tuple) else (got, time.perf_counter() - start)
                results[name]["runs"].append(tokens / seconds)
            except Exception as e:  # noqa: BLE001
                results[name]["error"] = _one_line(e)
                del runs[name]
    return results


def fidelity(bench: Bench, n: int) -> dict[str, dict]:
    """Cost of bfloat16 and packed against float32: greedy on every bench prompt, then the
    float32 model teacher-forced on the same tokens (lmtrace.scoring.teacher.verify.float32_cost)."""
    from lmtrace.scoring.teacher.verify import cached_greedy, float32_cost

    found = {}
    runs = (("bfloat16", bench.bf16), ("packed", bench.packed), ("packed, torch's kernel", bench.packed_torch))
    for label, lm in runs:
        if lm is None:
            continue
        worst, diffs, agree, steps = 0.0, 0.0, 0.0, 0
        for prompt in PROMPTS:
            ids = lmtrace.encode_prompt(lm, prompt)
            tokens, logits = cached_greedy(lm, ids, n)
            cost = float32_cost(bench.lm.model, ids, tokens, torch.log_softmax(logits.float(), -1))
            worst = max(worst, cost["max"])
            diffs, agree = diffs + cost["mean"] * len(tokens), agree + cost["top1"] * len(tokens)
            steps += len(tokens)
        found[label] = {"max_abs_logprob_diff": worst, "mean_abs_logprob_diff": diffs / steps,
                        "top1_agreement": agree / steps, "steps": steps}  # fmt: skip
    return found


def _one_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: " if not isinstance(e, Failed) else "") + " ".join(str(e).split())[:300]


def table(record: dict) -> str:
    gbs = record["bandwidth"]["best"]
    lines = ["| contender | batch | weights | median tok/s | runs | ratio to model.generate | of its bound |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, r in record["results"].items():
        name, batch = key.rsplit(" @ batch ", 1)
        if not r["runs"]:
            lines.append(f"| {name} | {batch} | {r['weights']} | — | {r.get('error', 'no runs')} | | |")
            continue
        med = statistics.median(r["runs"])
        base = record["results"].get(f"model.generate @ batch {batch}", {}).get("runs")
        ratio = f"{med / statistics.median(base):.2f}" if base else "—"
        frac = med / r["bound"] if r.get("bound") else None
        flag = "" if frac is None or frac <= 1 else " (above the bound: probe error)"
        runs = ", ".join(f"{v:.1f}" for v in r["runs"])
        lines.append(f"| {name} | {batch} | {r['weights']} | {med:.1f} | {runs} | {ratio} | "
                     f"{'—' if frac is None else f'{frac:.0%}'}{flag} |")  # fmt: skip
    methods = ", ".join(k for k in record["bandwidth"] if k not in ("best", "threads"))
    lines.append(f"\nread bandwidth {gbs:.1f} GB/s (best of {methods}"
                 f" with {record['bandwidth']['threads']} threads); weights read per token: "
                 + ", ".join(f"{k} {v / 1e6:.0f} MB (bound {gbs * 1e9 / v:.1f} tok/s at batch 1)"
                             for k, v in record["step_bytes"].items()))  # fmt: skip
    for label, f in record.get("exact_paths", {}).items():
        lines.append(
            f"{label} vs the default float32 path: tokens identical {f['tokens_identical']}, "
            f"max |Δlogprob| {f['max_abs_logprob_diff']:.2g}"
        )
    for label, f in record.get("fidelity", {}).items():
        lines.append(f"fidelity {label} vs float32 over {f['steps']} greedy steps: max |Δlogprob| "
                     f"{f['max_abs_logprob_diff']:.3g}, mean |Δlogprob| (chosen) {f['mean_abs_logprob_diff']:.3g}, "
                     f"top-1 agreement {f['top1_agreement']:.1%}")  # fmt: skip
    if "inside" in record:
        lines.append("\n| inside each step | step time / plain traced |\n|---|---|")
        lines += [f"| {k} | {r:.2f}x |" for k, r in record["inside"]["step_time_ratio"].items()]
        for top, row in record["inside"]["json_bytes_per_step"].items():
            lines.append(f"JSON bytes per step, {top}: " + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in row.items()))
    return "\n".join(lines)


def load_all(args) -> Bench:
    model = Path(args.model).expanduser() if args.model else None
    source = str(model) if model else None
    lm = lmtrace.load(source, device="cpu", dtype="float32")
    bench = Bench(tokens=args.tokens, compile=not args.no_compile, lm=lm, inside=args.inside, model=model)
    bench.step_bytes["float32"] = weights_read_per_token(lm.model)
    bench.step_bytes["gguf"] = gguf_bytes(gguf_file(model))
    if not args.no_onednn:
        bench.onednn = lmtrace.load(source, device="cpu", dtype="float32", matmul="onednn")
    if not args.no_fused:
        bench.fused = lmtrace.load(source, device="cpu", dtype="float32", matmul="onednn-fused")
    if not args.no_bf16:
        bench.bf16 = lmtrace.load(source, device="cpu", dtype="bfloat16")
        bench.step_bytes["bfloat16"] = weights_read_per_token(bench.bf16.model)
    if not args.no_packed:
        started = time.perf_counter()
        bench.packed = lmtrace.load(source, device="cpu", dtype="float32", weights="packed")
        from lmtrace.model.gguf import packed
        from lmtrace.model.gguf.packed import report_of

        bench.packed_types = report_of(bench.packed.model).types()
        bench.step_bytes["packed"] = weights_read_per_token(bench.packed.model)
        bench.packed_load_s = time.perf_counter() - started
        if not args.no_packed_torch and packed.default_compute() == torch.float32:
            with mock.patch.object(packed, "default_compute", lambda: torch.bfloat16):
                bench.packed_torch = lmtrace.load(source, device="cpu", dtype="float32", weights="packed")
            bench.step_bytes["packed-torch"] = weights_read_per_token(bench.packed_torch.model)
    return bench


def main() -> None:
    if any(a == "--device" or a.startswith("--device=") for a in sys.argv[1:]):  # random-weight shapes on a device
        import decode_shapes

        decode_shapes.main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 contender")
    ap.add_argument("--no-onednn", action="store_true", help="skip the float32 --matmul onednn contender")
    ap.add_argument("--no-fused", action="store_true", help="skip the float32 --matmul onednn-fused contender")
    ap.add_argument("--no-packed", action="store_true", help="skip the packed 4-bit contender")
    ap.add_argument(
        "--no-packed-torch",
        action="store_true",
        help="skip packed 4-bit on torch's bfloat16 int4 kernel (what runs without a C compiler)",
    )
    ap.add_argument("--no-compile", action="store_true", help="skip lmtrace --compile (a one-off compile)")
    ap.add_argument("--inside", action="store_true", help="also time --lens, --attention and both")
    ap.add_argument("--fidelity-tokens", type=int, default=32, help="greedy steps per prompt for the fidelity check")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/decode-<time>.json)")
    ap.add_argument("--model", default=None, help="a GGUF file to run (default: the bundled SmolLM2 Q4_1 file)")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still writes what was measured
    out = Path(args.out or f"bench/results/decode-{time.strftime('%Y%m%d-%H%M%S')}.json")
    record = {"machine": {"platform": platform.platform(), "processor": _cpu_name(), "cores": os.cpu_count(),
                          "torch_threads": torch.get_num_threads()},
              "versions": versions(), "tokens": args.tokens, "rounds": args.rounds, "results": {}, "errors": {},
              "step_bytes": {}, "bandwidth": {"best": float("nan"), "threads": torch.get_num_threads()}}  # fmt: skip
    try:
        record["bandwidth"] = bandwidth.probe()
        bench = load_all(args)
        record["step_bytes"], record["packed_load_s"] = bench.step_bytes, getattr(bench, "packed_load_s", None)
        record["model"], record["packed_types"] = str(gguf_file(bench.model)), getattr(bench, "packed_types", None)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            for name, r in measure(bench, batch, args.rounds, record["errors"]).items():
                r["bound"] = batch * record["bandwidth"]["best"] * 1e9 / bench.step_bytes[r["weights"]]
                r["median"] = statistics.median(r["runs"]) if r["runs"] else None
                record["results"][f"{name} @ batch {batch}"] = r
            _write(out, record)  # what is measured so far survives a run cut short
        if args.inside:
            batches = [int(b) for b in args.batch_sizes.split(",")]
            record["inside"] = inside_summary(record, batches, json_bytes_per_step(bench.lm, 16))
        record["exact_paths"] = exact_paths(bench, args.fidelity_tokens)
        _write(out, record)
        record["fidelity"] = fidelity(bench, args.fidelity_tokens)
    except BaseException as e:  # noqa: BLE001 - whatever happens, what was measured is written
        record["errors"]["run"] = _one_line(e)
        raise
    finally:
        what = args.model or "bundled SmolLM2-135M-Instruct"
        print(f"{what}, CPU, greedy, {args.tokens} new tokens, {args.rounds} rounds\n")
        print(table(record))
        _write(out, record)
        print(f"\nwritten to {out}")


def _write(out: Path, record: dict) -> None:
    from lmtrace.files import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(record, indent=2))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
