"""One matmul per packed GGUF type against float32, side by side: a (4096 x 4096) weight of each
type (random blocks, as tests/test_packed_types.py builds them), one row of input (a decode step),
medians over rounds with the contenders interleaved in every round. Each figure is also a
fraction of its bandwidth bound (bytes the matmul reads over bench/bandwidth.py's probe).
Writes the table and a JSON record (also when a contender fails).
Usage: python bench/packed_types.py [--rounds 5] [--size 4096] [--rows 1] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bandwidth  # noqa: E402

from lmtrace.model.gguf.blocks import int4_form  # noqa: E402
from lmtrace.model.gguf.packed import PackedLinear  # noqa: E402
from lmtrace.model.gguf.quants import TYPES  # noqa: E402
from lmtrace.versions import versions  # noqa: E402


def random_blocks(type_name: str, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    block, nbytes, *_ = TYPES[type_name]
    raw = rng.integers(0, 256, (out * inp // block, nbytes), dtype=np.uint8)
    d = 10 ** rng.uniform(-4, -2, (raw.shape[0], 1))
    at = 208 if type_name == "Q6_K" else 0
    raw[:, at : at + 2] = d.astype(np.float16).view(np.uint8)
    if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # m / dmin: a few times d
        raw[:, 2:4] = (d * rng.uniform(1, 16, d.shape)).astype(np.float16).view(np.uint8)
    return raw.reshape(out, -1)


def timed(fn, x: torch.Tensor, repeat: int) -> float:
    """Seconds per call, the best of `repeat` calls after a warm-up call."""
    fn(x)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1, help="input rows (1: a decode step)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or f"bench/results/packed-types-{time.strftime('%Y%m%d-%H%M%S')}.json")
    n, rng = args.size, np.random.default_rng(0)
    x = torch.randn(args.rows, n)
    record = {"versions": versions(), "size": n, "rows": args.rows, "threads": torch.get_num_threads(),
              "bandwidth": bandwidth.probe(), "results": {}, "errors": {}}  # fmt: skip
    contenders = {"float32": (torch.nn.Linear(n, n, bias=False).requires_grad_(False), 4 * n * n)}
    for name in TYPES:
        try:
            layer = PackedLinear(int4_form(name, random_blocks(name, n, n, rng), n, n), None, torch.bfloat16, name)
            contenders[name] = (layer, layer.nbytes())
        except Exception as e:  # noqa: BLE001 - a type that fails is that contender's result
            record["errors"][name] = f"{type(e).__name__}: {e}"
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (layer, _) in contenders.items():
                runs[name].append(timed(layer, x, 5))
    gbs = record["bandwidth"]["best"]
    base = statistics.median(runs["float32"])
    lines = ["| weights | pieces | MB read | median µs | speed vs float32 | of its bound |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, (layer, nbytes) in contenders.items():
        med = statistics.median(runs[name])
        bound = nbytes / (gbs * 1e9)
        record["results"][name] = {"runs_s": runs[name], "median_s": med, "bytes": nbytes,
                                   "pieces": getattr(layer, "pieces", None), "of_bound": bound / med}  # fmt: skip
        lines.append(f"| {name} | {getattr(layer, 'pieces', '—')} | {nbytes / 1e6:.1f} | {med * 1e6:.0f} | "
                     f"{base / med:.2f}x | {bound / med:.0%} |")  # fmt: skip
    print(f"({n} x {n}) weight, {args.rows} input row(s), {record['threads']} threads, bandwidth {gbs:.1f} GB/s\n")
    print("\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
