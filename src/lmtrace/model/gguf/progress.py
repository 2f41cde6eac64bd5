"""A progress line on stderr for work on a GGUF file's tensors that takes more than 2 s (the
float32 conversion, packing): "label: 120 / 253 MB (47%)", redrawn in place at most every half
second, ended by a newline once done. Shorter work prints nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

AFTER_S, EVERY_S = 2.0, 0.5


class Progress:
    """Bytes done of `total`, shown once the work has run `after` seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, after: float = AFTER_S) -> None:
        self.label, self.total, self.done = label, max(int(total), 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self.started, self.after, self.shown_at = time.perf_counter(), after, None

    def advance(self, nbytes: int) -> None:
        self.done += int(nbytes)
        now = time.perf_counter()
        if now - self.started < self.after or (self.shown_at is not None and now - self.shown_at < EVERY_S):
            return
        self.shown_at = now
        self.stream.write(f"\r{self.text()}")
        self.stream.flush()

    def text(self) -> str:
        return f"{self.label}: {self.done / 1e6:.0f} / {self.total / 1e6:.0f} MB ({self.done / self.total:.0%})"

    def close(self) -> None:
        """Ends the line (with its final figure) if it was shown."""
        if self.shown_at is not None:
            self.done = min(self.done, self.total)
            self.stream.write(f"\r{self.text()}, {time.perf_counter() - self.started:.1f} s\n")
            self.stream.flush()


def tensors(items: Iterable[Any], label: str, after: float = AFTER_S) -> Iterator[Any]:
    """Yields the GGUF reader's tensors, advancing a Progress by each one's bytes once it is done."""
    items = list(items)
    progress = Progress(label, sum(int(t.n_bytes) for t in items), after=after)
    try:
        for t in items:
            yield t
            progress.advance(int(t.n_bytes))
    finally:
        progress.close()
