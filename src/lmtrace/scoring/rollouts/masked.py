"""What the trainers' batch dumps share (TRL, verl): rows of padded ids with masks, and the
sampling settings as top-level keys."""

from __future__ import annotations

from typing import Any

from lmtrace.scoring.rollouts.rollout import bad, ids_of, logprobs_of, sampling_of


def _rows(obj: dict[str, Any], name: str, line: int) -> list[list[Any]] | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise bad(line, name, "must be a non-empty list (a row, or a batch of rows)")
    return value if isinstance(value[0], list) else [value]


def _kept(line: int, name: str, row: list[Any], mask: list[Any] | None) -> list[Any]:
    if not isinstance(row, list):
        raise bad(line, name, f"must be a row (a list), got {type(row).__name__}")
    if mask is None:
        return row
    if not isinstance(mask, list) or len(mask) != len(row):
        got = len(mask) if isinstance(mask, list) else f"no list but a {type(mask).__name__}"
        raise bad(line, name, f"has {len(row)} columns but its mask has {got}")
    return [x for x, m in zip(row, mask) if m]


def _logprob_row(
    line: int, name: str, row: list[Any], c_row: list[Any], c_mask: list[Any] | None, c_name: str, kept: int
) -> list[Any]:
    """A row of logprobs: padded as its completion row (the mask drops the same columns), or
    already of its `kept` ids alone; any other width is an error naming both."""
    if isinstance(row, list) and len(row) == len(c_row):
        return _kept(line, name, row, c_mask)
    if isinstance(row, list) and len(row) == kept:
        return row
    width = len(row) if isinstance(row, list) else type(row).__name__
    raise bad(line, name, f"has {width} values for the {len(c_row)} columns of {c_name} ({kept} ids once unpadded)")


def batch_rows(
    obj: dict[str, Any], line: int, prompt: tuple[str, str], completion: tuple[str, str], logprobs: str
) -> list[tuple[list[int], list[int], list[float]]]:
    """[(prompt ids, completion ids, logprobs)] of each row, padding dropped by the masks."""
    p_rows, c_rows = _rows(obj, prompt[0], line), _rows(obj, completion[0], line)
    if p_rows is None:
        raise bad(line, prompt[0], "is missing")
    if c_rows is None:
        raise bad(line, completion[0], "is missing")
    l_rows = _rows(obj, logprobs, line)
    if l_rows is None:
        raise bad(line, logprobs, "is missing")
    p_masks, c_masks = _rows(obj, prompt[1], line), _rows(obj, completion[1], line)
    for name, rows in ((completion[0], c_rows), (logprobs, l_rows), (prompt[1], p_masks), (completion[1], c_masks)):
        if rows is not None and len(rows) != len(p_rows):
            raise bad(line, name, f"has {len(rows)} rows for {len(p_rows)} prompts")
    out = []
    for i in range(len(p_rows)):
        p = _kept(line, f"{prompt[0]}[{i}]", p_rows[i], p_masks[i] if p_masks else None)
        c_mask = c_masks[i] if c_masks else None
        c = _kept(line, f"{completion[0]}[{i}]", c_rows[i], c_mask)
        c = ids_of(line, f"{completion[0]}[{i}]", c)
        lp = _logprob_row(line, f"{logprobs}[{i}]", l_rows[i], c_rows[i], c_mask, f"{completion[0]}[{i}]", len(c))
        out.append((ids_of(line, f"{prompt[0]}[{i}]", p), c, logprobs_of(line, f"{logprobs}[{i}]", lp, len(c))))
    return out


def settings(obj: dict[str, Any], line: int) -> dict[str, Any]:
    """The sampling settings: a "sampling" object, else the top-level keys."""
    if isinstance(obj.get("sampling"), dict):
        return sampling_of(line, obj["sampling"])
    return sampling_of(line, {k: obj[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in obj})
