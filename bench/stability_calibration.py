"""Calibration of the stability ledger's flags on the bundled model: do the flagged tokens catch
the tokens that really flip?

For every prompt of bench/stability_prompts.txt (chat template, greedy, --tokens tokens) the
reference is decoded once and its tokens teacher-forced under every CPU variant. A variant's
flips (its top-1 differs from the reference's) are then predicted with the noise estimated
leave-one-variant-out: sigma from the other variants only, a step flagged when its margin is
below threshold x sigma. Printed per threshold and per noise rule (the ledger's, lmtrace.scoring.
noise.sigma; the per-step largest change alone and the per-step root-mean-square, for
comparison): recall of the flips, precision (flagged steps that flip under the held-out variant),
precision against a flip under any variant, the fraction of steps flagged.

Usage: python bench/stability_calibration.py [--tokens 32] [--limit N] [--vllm] [--threads 1] [--json OUT]
       python bench/stability_calibration.py --from OUT   (the tables again from a saved run)"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import torch

import lmtrace
from lmtrace.model.folder import save_folder
from lmtrace.scoring.stability import noise
from lmtrace.scoring.stability.ledger import forced_steps, reference_of
from lmtrace.scoring.variants.spec import parse_variant
from lmtrace.scoring.variants.worlds import build

PROMPTS = Path(__file__).with_name("stability_prompts.txt")
THRESHOLDS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)


def cpu_variants(folder: Path, vllm: bool) -> list[str]:
    threads = 1 if torch.get_num_threads() > 1 else 2
    specs = ["dtype:bfloat16", "dtype:float16", "weights:packed", "attention:eager", "batch:4",
             f"threads:{threads}", "compile", f"model:{folder}"]  # fmt: skip
    return specs + (["engine:vllm"] if vllm else [])


def label(spec: str) -> str:
    return "model:(bundled, weights rounded to bfloat16)" if spec.startswith("model:") else spec


def largest(changes: list[list[float | None]]) -> list[float | None]:
    """Per step, the largest |change| over the variants (no level)."""
    n = max((len(c) for c in changes), default=0)
    return [max((abs(c[i]) for c in changes if c[i] is not None), default=None) for i in range(n)]


def rms(changes: list[list[float | None]]) -> list[float | None]:
    """Per step, the root-mean-square of the changes over the variants."""
    n = max((len(c) for c in changes), default=0)
    out = []
    for i in range(n):
        seen = [c[i] ** 2 for c in changes if c[i] is not None]
        out.append(math.sqrt(sum(seen) / len(seen)) if seen else None)
    return out


def collect(lm, worlds: dict, prompts: list[str], tokens: int, save: Path | None = None) -> list[dict]:
    """Per prompt: margins, and per variant its margin changes and flips along the reference;
    with `save`, the items so far are written there after each prompt (a long run can be cut)."""
    out = []
    for k, prompt in enumerate(prompts):
        started = time.perf_counter()
        trace = lmtrace.generate(lm, prompt, chat=True, temperature=0, max_new_tokens=tokens, top_logprobs=2)
        ref = reference_of(lm, trace)
        item = {"prompt": prompt, "margins": [s.top[0].logprob - s.top[1].logprob for s in trace.steps],
                "changes": {}, "flipped": {}, "deltas": {}}  # fmt: skip
        for spec, world in worlds.items():
            steps = forced_steps(ref, world.forced(ref.ids + ref.tokens, len(ref.ids)))
            item["changes"][spec] = [s["margin_change"] for s in steps]
            item["flipped"][spec] = [s["flipped"] for s in steps]
            item["deltas"][spec] = [s["delta"] for s in steps]
        flips = sum(sum(f) for f in item["flipped"].values())
        print(f"[{k + 1}/{len(prompts)}] {time.perf_counter() - started:5.1f} s, {flips} flips: {prompt[:50]}",
              flush=True)  # fmt: skip
        out.append(item)
        if save is not None:
            save.write_text(json.dumps({"variants": list(worlds), "items": out}), encoding="utf-8")
    return out


def score(items: list[dict], threshold: float, rule) -> dict:
    """Leave-one-variant-out recall and precision over every prompt and variant."""
    flips = caught = flagged = flagged_same = flagged_any = 0
    per: dict[str, list[int]] = {}
    for item in items:
        specs = list(item["changes"])
        any_flip = [any(item["flipped"][s][i] for s in specs) for i in range(len(item["margins"]))]
        for held in specs:
            sigma = rule([item["changes"][s] for s in specs if s != held])
            flags = [noise.is_flagged(m, sigma[i], threshold) for i, m in enumerate(item["margins"])]
            own = item["flipped"][held]
            flips += sum(own)
            caught += sum(f and g for f, g in zip(own, flags))
            flagged += sum(flags)
            flagged_same += sum(f and g for f, g in zip(own, flags))
            flagged_any += sum(a and g for a, g in zip(any_flip, flags))
            p = per.setdefault(held, [0, 0])
            p[0], p[1] = p[0] + sum(own), p[1] + sum(f and g for f, g in zip(own, flags))
    steps = sum(len(i["margins"]) for i in items) * len(items[0]["changes"])
    return {
        "threshold": threshold, "flips": flips, "caught": caught, "recall": caught / flips if flips else None,
        "precision": flagged_same / flagged if flagged else None,
        "precision_any": flagged_any / flagged if flagged else None, "flag_rate": flagged / steps,
        "per_variant": {k: {"flips": v[0], "caught": v[1]} for k, v in per.items()},
    }  # fmt: skip


def table(rows: list[dict], rule: str) -> str:
    lines = [f"noise rule: {rule}", "| threshold | flips | caught | recall | precision | precision (any) | flagged |",
             "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        f = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
        lines.append(f"| {r['threshold']:g} | {r['flips']} | {r['caught']} | {f(r['recall'])} | {f(r['precision'])} "
                     f"| {f(r['precision_any'])} | {100 * r['flag_rate']:.1f}% |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="Only the first N prompts.")
    ap.add_argument("--vllm", action="store_true", help="Also engine:vllm (vLLM on this CPU).")
    ap.add_argument("--json", default=None, help="Write the per-prompt numbers and the tables here.")
    ap.add_argument("--from", dest="saved", default=None, help="Print the tables of a run saved with --json.")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the reference (default 1: on a "
        "shared machine two threads wait for each other); the threads variant uses another count",
    )
    args = ap.parse_args()
    if args.saved:
        saved = json.loads(Path(args.saved).read_text(encoding="utf-8"))
        keep = ("machine", "prompts", "tokens", "variants")
        report, items = {k: v for k, v in saved.items() if k in keep}, saved["items"]
    else:
        report, items = run(args)
    print(json.dumps(report))
    for name, rule in (("ledger", noise.sigma), ("largest", largest), ("rms", rms)):
        rows = [score(items, t, rule) for t in THRESHOLDS]
        report[name] = rows
        print(table(rows, name))
        print("per variant at 2:", json.dumps(rows[THRESHOLDS.index(2.0)]["per_variant"]) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "items": items}, indent=1), encoding="utf-8")


def run(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    torch.set_num_threads(args.threads)
    prompts = [p for p in PROMPTS.read_text(encoding="utf-8").splitlines() if p.strip()][: args.limit]
    lm = lmtrace.load()
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_folder(lmtrace.load(dtype="bfloat16"), Path(tmp) / "smollm2-bf16-weights")  # weights in bf16
        started = time.perf_counter()
        worlds = {label(spec): build(lm, parse_variant(spec)) for spec in cpu_variants(folder, args.vllm)}
        print(f"variants built in {time.perf_counter() - started:.0f} s: {', '.join(worlds)}", flush=True)
        items = collect(lm, worlds, prompts, args.tokens, Path(args.json) if args.json else None)
    report = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "prompts": len(prompts),
              "tokens": args.tokens, "variants": list(worlds)}  # fmt: skip
    return report, items


if __name__ == "__main__":
    main()
