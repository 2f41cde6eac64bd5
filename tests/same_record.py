"""Compares traces and batch records as a reader would: timings (which differ between any two
runs) are left out, floats agree within a tolerance (a padded batch sums in another order),
everything else exactly: token ids, text, ranks, the KV cache record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

TIMING = {"timing", "time_ms"}


def assert_same(a: Any, b: Any, tol: float = 1e-4, path: str = "") -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{path}: keys differ: {sorted(a.keys() ^ b.keys())}"
        for k in a:
            if k not in TIMING:
                assert_same(a[k], b[k], tol, f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, tol, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == b or abs(a - b) <= tol, f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every line of a batch output, which must all be complete JSON records."""
    data = path.read_text(encoding="utf-8")
    assert data == "" or data.endswith("\n")
    return [json.loads(line) for line in data.split("\n") if line]


def by_id(records: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), f"an id is written twice: {ids}"
    return {r["id"]: r for r in records}


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's matrices are too small for threads to help, and on a busy machine two
    threads that wait for each other make every step slow: one thread while the test runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
