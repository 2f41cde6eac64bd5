"""The input of a batch job: one JSON object per line, each with an `id`.

Lines are split on "\\n" only: a prompt may hold U+2028 or other characters that
str.splitlines() would also split on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrace.errors import InvalidParameter


@dataclass
class InputLine:
    """One line of the input: its 1-based number, its id and the whole object."""

    number: int
    id: str | int
    data: dict[str, Any]

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(value: str | int) -> str:
    """The id as the output compares it: 7 and "7" are different ids."""
    return json.dumps(value, ensure_ascii=False)


def valid_id(value: Any) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def split_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based number, line) for every line, blank ones included, without the line end."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        yield number, raw.rstrip(b"\r")


def read_input(path: str | Path) -> tuple[list[InputLine], list[str]]:
    """The lines of a job and the problems of those that cannot be answered by id (not JSON,
    no id, an id already used by an earlier line): they get no output line."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidParameter(f"input: cannot read {str(path)!r} ({e.strerror})") from e
    lines: list[InputLine] = []
    problems: list[str] = []
    first_seen: dict[str, int] = {}
    for number, raw in split_lines(data):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            problems.append(f"{where}: not a JSON object ({type(e).__name__}: {e}); skipped")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{where}: not a JSON object; skipped")
            continue
        if not valid_id(obj.get("id")):
            problems.append(f"{where}: id must be a string or an integer, got {obj.get('id')!r}; skipped")
            continue
        line = InputLine(number, obj["id"], obj)
        if line.key in first_seen:
            problems.append(f"{where}: id {line.key} repeats line {first_seen[line.key]}; skipped")
            continue
        first_seen[line.key] = number
        lines.append(line)
    return lines, problems
