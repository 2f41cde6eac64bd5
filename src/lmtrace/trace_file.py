"""A trace's two file forms, written step by step (no whole-document string) and read back to
the dict `Trace.from_dict` takes:

- JSON (`--json`): one compact document, the steps last; indented only when asked.
- JSON Lines (`--jsonl`): a header line (everything known before decoding: the model, params,
  prompt, versions), one line per step, and a closing line (the text, finish reason, timing and
  the trace-level summaries); each step's line is written as the step comes.

Both hold the steps' lens and attention in columns (lmtrace.columnar; the trace then says `columnar`),
and both are written atomically (lmtrace.files.atomic_text)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from lmtrace.columnar import FORM, KEY, OLD_KEY, Tokens, from_columns, is_columnar, to_columns
from lmtrace.files import atomic_text
from lmtrace.records import Step, Trace

LINE = "lmtrace"  # a JSON Lines header's and closing line's kind: "header", "end"
HEADER = ("schema_version", "model", "params", "prompt", "versions", "origin", "distributions")


def dumps(x: Any, indent: int | None = None) -> str:
    """JSON as the files write it: UTF-8 text, no spaces unless indented, no NaN or infinity."""
    separators = (",", ":") if indent is None else (",", ": ")
    return json.dumps(x, ensure_ascii=False, allow_nan=False, indent=indent, separators=separators)


def _prompt_ids(d: dict[str, Any]) -> list[int]:
    return list((d.get("prompt") or {}).get("token_ids") or [])


def _packs(trace: Trace) -> bool:
    return any(s.lens is not None or s.attention is not None for s in trace.steps)


def write_json(out: IO[str], trace: Trace, indent: int | None = None, columnar: bool = False) -> None:
    """The trace as one JSON document, the steps written one at a time. `--json` keeps the
    documented shape (`columnar` False); with `columnar` the lens and attention are in columns as in
    `--jsonl`."""
    head = trace.head_dict()
    tokens = Tokens(_prompt_ids(head)) if columnar and _packs(trace) else None
    if tokens is not None:
        head = {KEY: FORM, **head}
    text = dumps(head, indent)  # "{...}", or "{\n  ...\n}" indented
    pad = "" if indent is None else "\n" + " " * indent
    inner = "" if indent is None else pad + " " * indent
    out.write(text[:-1].rstrip() + "," + pad + ('"steps":[' if indent is None else '"steps": ['))
    for k, step in enumerate(trace.step_dicts()):
        if tokens is not None:
            step = to_columns(step, tokens)
        out.write(("," if k else "") + inner + dumps(step, indent).replace("\n", inner))
    out.write((pad if trace.steps else "") + "]" + ("}" if indent is None else "\n}") + "\n")


def save_json(path: str | Path, trace: Trace, indent: int | None = None, columnar: bool = False) -> None:
    """write_json to a file, atomically."""
    with atomic_text(path) as out:
        write_json(out, trace, indent, columnar)


class TraceLines:
    """A `--jsonl` file being written: `step(step)` as each step comes (its line goes to a spool
    beside the file at once), then `close(trace)` writes the header, the spooled steps and the
    closing line under a temporary name and renames it; `discard()` (or an exception inside a
    `with`) leaves nothing. `prompt_ids`: the prompt's token ids, for packing the attention."""

    def __init__(self, path: str | Path, prompt_ids: list[int]):
        self.path = Path(path)
        self.prompt_ids = list(prompt_ids)
        self.tokens = Tokens(self.prompt_ids)
        self.spool = tempfile.NamedTemporaryFile(
            "w+", encoding="utf-8", prefix=f".{self.path.name}.", suffix=".steps.tmp", dir=self.path.parent or "."
        )
        self.count = 0

    def step(self, step: Step) -> None:
        self.spool.write(dumps(to_columns(step.to_dict(), self.tokens)) + "\n")
        self.count += 1

    def close(self, trace: Trace) -> None:
        """The file under its name: header, steps, closing line."""
        try:
            spooled = self.count == len(trace.steps) and self.prompt_ids == _prompt_ids(trace.prompt)
            spooled = spooled and trace.speculative is None  # a speculative step's draft entry comes with the trace
            with atomic_text(self.path) as out:
                write_lines(out, trace, self.spool if spooled else None)
        finally:
            self.discard()

    def discard(self) -> None:
        self.spool.close()  # a NamedTemporaryFile deletes itself

    def __enter__(self) -> TraceLines:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.discard()


def write_lines(out: IO[str], trace: Trace, spool: IO[str] | None = None) -> None:
    """The trace as JSON Lines; the step lines copied from `spool` where they were written as they
    came (TraceLines), else made here."""
    head = trace.head_dict()
    out.write(dumps({LINE: "header", KEY: FORM, **{k: head[k] for k in HEADER if k in head}}) + "\n")
    if spool is not None:
        spool.flush()
        spool.seek(0)
        shutil.copyfileobj(spool, out)
    else:
        tokens = Tokens(_prompt_ids(head))
        for step in trace.step_dicts():
            out.write(dumps(to_columns(step, tokens)) + "\n")
    closing = {k: v for k, v in head.items() if k not in HEADER}
    if closing.get("token_ids") == [s.token_id for s in trace.steps]:
        del closing["token_ids"]  # the steps hold them
    out.write(dumps({LINE: "end", **closing}) + "\n")


def expanded(d: dict[str, Any]) -> dict[str, Any]:
    """A trace dict read from a file with its columnar steps expanded (`Trace.to_dict()`'s shape)."""
    tokens = Tokens(_prompt_ids(d))
    out = {k: v for k, v in d.items() if k not in (KEY, OLD_KEY)}
    out["steps"] = [from_columns(s, tokens) for s in d["steps"]]
    return out


def _from_lines(head: dict[str, Any], lines: Iterator[str], parse: Callable[[str], Any]) -> dict[str, Any]:
    tokens = Tokens(_prompt_ids(head))
    steps, closing = [], None
    for n, line in enumerate(lines, start=2):
        if not line.strip():
            continue
        if closing is not None:
            raise ValueError(f"line {n}: a line after the closing line")
        d = parse(line)
        if not isinstance(d, dict):
            raise ValueError(f"line {n}: not a JSON object")
        if LINE in d:
            closing = d
        else:
            steps.append(from_columns(d, tokens))
    if closing is None or closing.get(LINE) != "end":
        raise ValueError("the JSON Lines trace has no closing line (cut short?)")
    out = {k: v for k, v in head.items() if k not in (LINE, KEY, OLD_KEY)}
    out.update((k, v) for k, v in closing.items() if k != LINE)
    out.setdefault("token_ids", [s["token_id"] for s in steps])
    out["steps"] = steps
    return out


def loads(text: str) -> Any:
    """A trace file's text (JSON or JSON Lines) as the dict `Trace.to_dict()` gives; any other
    JSON as it is. Raises ValueError (json.JSONDecodeError) on what is neither."""
    first, _, rest = text.lstrip().partition("\n")
    if rest.strip() and first.startswith("{"):
        try:
            head = json.loads(first)
        except ValueError:
            head = None
        if isinstance(head, dict) and head.get(LINE) == "header":
            return _from_lines(head, iter(rest.split("\n")), json.loads)
    data = json.loads(text)
    if isinstance(data, dict) and is_columnar(data) and isinstance(data.get("steps"), list):
        return expanded(data)
    return data
