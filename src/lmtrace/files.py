"""Atomic file writes: a reader never sees a half-written file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO


def _mode(target: Path) -> int:
    """The mode a plain open() would give: the existing file's, else 0o666 less the umask
    (mkstemp makes 0o600 files, which would hide a report from the people it is for)."""
    try:
        return target.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextmanager
def _replacing(path: str | Path, mode: str, **how: str) -> Iterator[IO]:
    """A file opened under a temporary name in the target's folder, synced and renamed over the
    target when the block ends; an exception leaves no file under the target's name."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, mode, **how) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "fchmod"):  # not on Windows before Python 3.13
                os.fchmod(f.fileno(), _mode(target))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic_bytes(path: str | Path, data: bytes) -> None:
    """Writes to a temporary file in the same folder, then renames it over the target."""
    with _replacing(path, "wb") as f:
        f.write(data)


def write_atomic(path: str | Path, text: str) -> None:
    write_atomic_bytes(path, text.encode("utf-8"))


def atomic_text(path: str | Path) -> AbstractContextManager[IO[str]]:
    """A UTF-8 text file written piece by piece under a temporary name in the same folder and
    renamed over `path` when the block ends; an exception leaves no file under `path`."""
    return _replacing(path, "w", encoding="utf-8", newline="\n")
