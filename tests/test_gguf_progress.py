"""The progress line for long GGUF work (model/gguf/progress.py): nothing for work under 2 s,
else "label: done / total MB (n%)" redrawn in place on stderr and ended by one newline."""

from __future__ import annotations

import io
from types import SimpleNamespace

from lmtrace.model.gguf import progress


def test_short_work_prints_nothing():
    out = io.StringIO()
    p = progress.Progress("reading", 10_000_000, stream=out)
    p.advance(5_000_000)
    p.close()
    assert out.getvalue() == ""


def test_long_work_shows_bytes_done_of_total(monkeypatch):
    clock = iter([0.0, 3.0, 3.1, 4.0, 5.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    p = progress.Progress("converting tiny.gguf", 200_000_000, stream=out)  # started at 0.0
    p.advance(50_000_000)  # 3.0: past 2 s, shown
    p.advance(50_000_000)  # 3.1: under half a second since: not redrawn
    p.advance(100_000_000)  # 4.0: shown
    p.close()  # 5.0
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith(", 5.0 s\n")
    assert "converting tiny.gguf: 50 / 200 MB (25%)" in text and "100 / 200 MB" not in text
    assert "converting tiny.gguf: 200 / 200 MB (100%), 5.0 s" in text


def test_tensors_advance_by_each_tensors_bytes(monkeypatch):
    seen = []
    monkeypatch.setattr(progress.Progress, "advance", lambda self, n: seen.append(n))
    items = [SimpleNamespace(n_bytes=3), SimpleNamespace(n_bytes=5)]
    assert list(progress.tensors(items, "x")) == items and seen == [3, 5]
