"""Rollout files in each framework's format, one reader module per format: `lmtrace` (this
project's), `trl`, `verl`, `vllm` (a RequestOutput dump), `openai` (`logprobs.content` with token
ids). A file is JSON lines; each reader maps one line to its rollouts. Errors name the line and
the field; nothing is read half-way (the whole file is checked before any model runs)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.scoring.rollouts import read_lmtrace, read_openai, read_trl, read_verl, read_vllm
from lmtrace.scoring.rollouts.rollout import Rollout, bad

Reader = Callable[[dict[str, Any], int], list[Rollout]]
FORMATS: dict[str, Reader] = {
    "lmtrace": read_lmtrace.read,
    "trl": read_trl.read,
    "verl": read_verl.read,
    "vllm": read_vllm.read,
    "openai": read_openai.read,
}


def reader(fmt: str) -> Reader:
    """The reader of a format, or InvalidParameter naming the known ones."""
    if fmt not in FORMATS:
        raise InvalidParameter(f"format: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    return FORMATS[fmt]


def parse(objects: Iterable[tuple[int, Any]], fmt: str) -> list[Rollout]:
    """(line, parsed JSON) pairs in the format `fmt` as rollouts; ids must be unique."""
    read, out, seen = reader(fmt), [], {}
    for line, obj in objects:
        if not isinstance(obj, dict):
            raise bad(line, "line", f"must be a JSON object, got {type(obj).__name__}")
        for r in read(obj, line):
            if r.id in seen:
                raise bad(line, "id", f"{r.id!r} is used twice (first on line {seen[r.id]})")
            seen[r.id] = line
            out.append(r)
    if not out:
        raise InvalidParameter("rollouts: no rollout given (the file has no lines)")
    return out


def read_file(path: str | Path, fmt: str = "lmtrace") -> list[Rollout]:
    """The rollouts of a JSON-lines file (blank lines skipped)."""
    reader(fmt)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidParameter(f"rollouts: cannot read {str(path)!r} ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise InvalidParameter(f"rollouts: {str(path)!r} is not UTF-8 text (offset {e.start})") from e
    objects = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            objects.append((n, json.loads(raw)))
        except ValueError as e:
            raise bad(n, "line", f"is not JSON ({e.msg} at column {e.colno})") from e
    return parse(objects, fmt)


def from_records(records: Sequence[Any] | str | Path, fmt: str = "lmtrace") -> list[Rollout]:
    """Rollouts, dicts in the format `fmt` (record i is line i + 1), or the path of a file."""
    if isinstance(records, (str, Path)):
        return read_file(records, fmt)
    if all(isinstance(r, Rollout) for r in records):
        return list(records)
    return parse(((i + 1, r) for i, r in enumerate(records)), fmt)
