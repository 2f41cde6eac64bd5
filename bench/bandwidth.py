"""The machine's memory read bandwidth as a decode step can use it: all threads, the best of
several read-only kernels over buffers far larger than the caches. A single `x.sum()` can read
at half of what a multi-threaded matrix-vector product reaches, which once made a decode look
faster than "the bound"; any contender above 100% of this bound means the probe is wrong."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first touch / warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def probe(size_mb: int = 512, repeats: int = 5) -> dict[str, float]:
    """GB/s read by each method with torch's threads; "best" is the largest."""
    n = size_mb * 1024 * 1024 // 4
    x = torch.ones(n, dtype=torch.float32)
    rows = 4096
    matrix = x[: (n // rows) * rows].view(rows, -1)  # (4096, cols) float32
    vector = torch.ones(matrix.shape[1])
    tall = x[: (n // 2048) * 2048].view(-1, 2048)  # (rows', 2048): what a linear layer's weight looks like
    tall_vec = torch.ones(1, 2048)
    methods = {
        "sum": (lambda: x.sum(), x.numel() * 4),
        "amax": (lambda: x.amax(), x.numel() * 4),
        "mv": (lambda: torch.mv(matrix, vector), matrix.numel() * 4),
        "linear": (lambda: torch.nn.functional.linear(tall_vec, tall), tall.numel() * 4),
    }
    found = {name: nbytes / _best_seconds(fn, repeats) / 1e9 for name, (fn, nbytes) in methods.items()}
    found["best"] = max(found.values())
    found["threads"] = torch.get_num_threads()
    return found


if __name__ == "__main__":
    for name, value in probe().items():
        print(f"{name:>8}: {value:.1f}" + ("" if name == "threads" else " GB/s"))
