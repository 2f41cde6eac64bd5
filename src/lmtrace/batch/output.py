"""The output of a batch job: one record per line, appended and flushed as each is done.

A line counts only once its "\\n" is written, so a job killed part-way leaves complete lines
and at most one half-written last line. Opening the file again repairs that line (it is cut
off and done again) and reads which ids are complete; an exclusive lock keeps a second job
from writing the same file at the same time."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmtrace.batch.lines import id_key, valid_id
from lmtrace.errors import InvalidParameter

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, one job per file is then the user's to keep
    fcntl = None


def record_line(id_: str | int, trace: dict[str, Any] | None = None, error: str | None = None) -> str:
    """`{"id", "trace"}` or `{"id", "error"}` as one JSON line (without its "\\n")."""
    record = {"id": id_, "trace": trace} if error is None else {"id": id_, "error": error}
    return json.dumps(record, ensure_ascii=False, allow_nan=False)


class OutputFile:
    """Use as a context manager: on entering, `done` holds the keys (lines.id_key) of the ids
    already complete; `write` appends a line unless its id is already there."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.done: set[str] = set()
        self.repaired = 0  # bytes of a half-written last line that were cut off
        self._fd: int | None = None

    def __enter__(self) -> OutputFile:
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as e:
            raise InvalidParameter(f"output: cannot open {str(self.path)!r} ({e.strerror})") from e
        try:
            self._lock()
            self._read_done()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock
            self._fd = None

    def _lock(self) -> None:
        if fcntl is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise InvalidParameter(f"output: {self.path} is being written by another lmtrace batch job") from e

    def _read_done(self) -> None:
        complete_to = 0
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):  # the half-written last line of an interrupted job
                    break
                complete_to += len(raw)
                self.done.add(self._id_of(raw, number))
        size = os.fstat(self._fd).st_size
        if size > complete_to:
            os.ftruncate(self._fd, complete_to)
            self.repaired = size - complete_to

    def _id_of(self, raw: bytes, number: int) -> str:
        try:
            record = json.loads(raw.decode("utf-8"))
            if valid_id(record["id"]) and ("trace" in record or "error" in record):
                return id_key(record["id"])
        except (UnicodeDecodeError, ValueError, TypeError, KeyError):
            pass
        raise InvalidParameter(
            f"output: {self.path}:{number} is not a record of lmtrace batch (only a half-written last "
            "line is repaired); use another output file"
        )

    def write(self, key: str, line: str) -> bool:
        """Appends `line` and a "\\n", flushed to disk; False (and nothing written) when the
        id is already complete."""
        if key in self.done:
            return False
        data = (line + "\n").encode("utf-8")
        while data:
            written = os.write(self._fd, data)
            data = data[written:]
        os.fsync(self._fd)
        self.done.add(key)
        return True
