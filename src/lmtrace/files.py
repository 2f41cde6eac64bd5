"""Atomic file writes: a reader never sees a half-written file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic_bytes(path: str | Path, data: bytes) -> None:
    """Writes to a temporary file in the same folder, then renames it over the target."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, text: str) -> None:
    write_atomic_bytes(path, text.encode("utf-8"))
