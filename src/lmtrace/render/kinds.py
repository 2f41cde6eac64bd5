"""What a record is: a trace, a score result, branches or a stability ledger. The renderers read plain dicts (the
JSON shape), so fields that other commands add later reach them without a change here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.records import SCHEMA_VERSION, Trace
from lmtrace.trace_file import expanded, is_columnar, loads

TRACE, SCORE, BRANCHES, STABILITY = "trace", "score", "branches", "stability"

_TRACE_KEYS = ("model", "params", "prompt", "steps")
_STEP_KEYS = ("token_id", "text", "logprob")


def kind_of(d: dict[str, Any]) -> str | None:
    """`stability` (its `kind`), `branches` ({"branches": [trace, ...]}), `score` (`tokens` and
    `perplexity`), `trace` (`steps`), or None."""
    if d.get("kind") == STABILITY:
        return STABILITY
    if isinstance(d.get("branches"), list):
        return BRANCHES
    if isinstance(d.get("tokens"), list) and "perplexity" in d:
        return SCORE
    if isinstance(d.get("steps"), list):
        return TRACE
    return None


def _check_trace(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"{where or 'the trace '}is not an object")
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{where}schema_version must be {SCHEMA_VERSION}, got {version!r}")
    missing = [k for k in _TRACE_KEYS if k not in d]
    if missing:
        raise ValueError(f"{where}missing {', '.join(missing)}")
    for i, s in enumerate(d["steps"]):
        if not isinstance(s, dict) or any(k not in s for k in _STEP_KEYS):
            raise ValueError(f"{where}step {i} lacks {', '.join(_STEP_KEYS)}")
    return d


def as_record(obj: Any) -> tuple[str, dict[str, Any]]:
    """(kind, dict) for a Trace, a list of Traces (branches), anything with `to_dict()`, or a
    dict in one of the three JSON shapes. Raises ValueError saying what is wrong."""
    if isinstance(obj, Trace):
        return TRACE, obj.to_dict()
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, Trace) for t in obj):
        return BRANCHES, {"branches": [t.to_dict() for t in obj]}
    if not isinstance(obj, dict) and callable(getattr(obj, "to_dict", None)):
        obj = obj.to_dict()
    if not isinstance(obj, dict):
        raise ValueError(f"expected a trace, a score result or branches, got {type(obj).__name__}")
    kind = kind_of(obj)
    if kind == TRACE:
        _check_trace(obj, "")
        if is_columnar(obj):  # a --json file's columnar lens and attention, expanded
            obj = expanded(obj)
    elif kind == BRANCHES:
        branches = [t.to_dict() if isinstance(t, Trace) else t for t in obj["branches"]]
        if not branches:
            raise ValueError("branches is empty")
        for i, t in enumerate(branches):
            _check_trace(t, f"branch {i}: ")
        obj = {**obj, "branches": branches}
    elif kind == STABILITY:
        _check_trace(obj.get("reference"), "reference: ")
        if not isinstance(obj.get("variants"), list) or not isinstance(obj.get("steps"), list):
            raise ValueError("a stability ledger needs its variants and steps")
    elif kind == SCORE:
        version = obj.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {version!r}")
    else:
        raise ValueError("not a trace (steps), a score result (tokens, perplexity), branches or a stability ledger")
    return kind, obj


def read_record(path: str | Path, parameter: str = "trace") -> tuple[str, dict[str, Any]]:
    """Reads a saved trace / score / branches JSON file. Bad input is an InvalidParameter that
    names the parameter and the file, in one line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidParameter(f"{parameter}: cannot read {str(path)!r} ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise InvalidParameter(f"{parameter}: {str(path)!r} is not UTF-8 text") from e
    try:
        data = loads(text)  # JSON, or a trace's JSON Lines (--jsonl)
    except ValueError as e:
        raise InvalidParameter(f"{parameter}: {str(path)!r} is not valid JSON ({e})") from e
    try:
        return as_record(data)
    except ValueError as e:
        raise InvalidParameter(f"{parameter}: {str(path)!r}: {e}") from e
