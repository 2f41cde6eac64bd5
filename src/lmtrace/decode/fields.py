"""How sure the model was of each value of a JSON output: the values found in the text (their
JSONPath, `$.city`, `$.items[2].name`, and their characters), and the steps that wrote them.

The rule for a token that spans a boundary: a token belongs to every value one of whose
characters it carries (a string value's quotes included), so `":"Par` counts in full for the
value "Paris". A token whose piece is empty (the first bytes of a character that a later token
completes) belongs with that character. A value's `logprob` is the sum of its tokens'
log-probabilities under the constraint (the raw distribution restricted to what the grammar
allowed), `raw_logprob` the same under the raw distribution, `min_prob` its least likely token
under the constraint. Pure Python over records: no torch."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from lmtrace.records import Step

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERAL = re.compile(r"true|false|null")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SPACE = " \t\n\r"


class _End(Exception):
    """The text ends (or stops being JSON) before the value does."""


class _Scanner:
    """Finds every leaf value (string, number, true/false/null, an empty object or array) of a
    JSON text with its path and character span; stops quietly where the text ends early."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0
        self.leaves: list[tuple[str, int, int]] = []

    def _skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _SPACE:
            self.pos += 1

    def _peek(self) -> str:
        self._skip()
        if self.pos >= len(self.text):
            raise _End
        return self.text[self.pos]

    def _string(self) -> int:
        """The end of the string starting at pos (past its closing quote)."""
        i = self.pos + 1
        while i < len(self.text):
            if self.text[i] == "\\":
                i += 2
            elif self.text[i] == '"':
                return i + 1
            else:
                i += 1
        raise _End

    def value(self, path: str, top: bool = False) -> None:
        c, start = self._peek(), self.pos
        if c == "{":
            self._container(path, "}", self._member)
        elif c == "[":
            self._container(path, "]", self._item)
        else:
            if c == '"':
                end = self._string()
            else:
                m = _NUMBER.match(self.text, start) or _LITERAL.match(self.text, start)
                if m is None:
                    raise _End
                end = m.end()
                if end == len(self.text) and not top and m.re is _NUMBER:
                    raise _End  # a number cut by the end of the text may go on
            self.pos = end
            self.leaves.append((path, start, end))

    def _container(self, path: str, close: str, part) -> None:
        start = self.pos
        self.pos += 1
        if self._peek() == close:
            self.pos += 1
            self.leaves.append((path, start, self.pos))
            return
        index = 0
        while True:
            part(path, index)
            c = self._peek()
            self.pos += 1
            if c == close:
                return
            if c != ",":
                raise _End
            index += 1

    def _member(self, path: str, index: int) -> None:
        if self._peek() != '"':
            raise _End
        start, end = self.pos, self._string()
        key = json.loads(self.text[start:end])
        self.pos = end
        if self._peek() != ":":
            raise _End
        self.pos += 1
        self.value(f"{path}.{key}" if _NAME.match(key) else f"{path}[{_quoted(key)}]")

    def _item(self, path: str, index: int) -> None:
        self.value(f"{path}[{index}]")


def _quoted(key: str) -> str:
    return "'" + key.replace("\\", "\\\\").replace("'", "\\'") + "'"


def leaves(text: str) -> list[tuple[str, int, int]]:
    """(JSONPath, start, end) of every complete leaf value of `text`, in document order."""
    scanner = _Scanner(text)
    try:
        scanner.value("$", top=True)
    except (_End, ValueError):
        pass
    return scanner.leaves


def token_spans(steps: Sequence[Step]) -> list[tuple[int, int]]:
    """Each step's characters [start, end) in the text the pieces join to; an empty piece
    covers the character that a later token completes."""
    out, pos = [], 0
    for s in steps:
        out.append((pos, pos + max(len(s.text), 1)))
        pos += len(s.text)
    return out


def _constrained(s: Step) -> float | None:
    if s.grammar is not None:
        return s.grammar.get("logprob")
    return s.sampled_logprob if s.sampled_logprob is not None else s.logprob


def fields(text: str, steps: Sequence[Step]) -> list[dict[str, Any]]:
    """Every leaf value of the JSON `text` with the steps that wrote it (see the module's rule):
    [{path, text, chars: [start, end) in `text`, start_step, end_step, logprob, raw_logprob, min_prob}]."""
    spans = token_spans(steps)
    out = []
    for path, start, end in leaves(text):
        mine = [s for s, (a, b) in zip(steps, spans) if a < end and b > start]
        if not mine:
            continue
        lps = [_constrained(s) for s in mine]
        known = [lp for lp in lps if lp is not None]
        raw = [s.logprob for s in mine if s.logprob is not None]
        out.append({
            "path": path,
            "text": text[start:end],
            "chars": [start, end],
            "start_step": mine[0].index,
            "end_step": mine[-1].index,
            "logprob": sum(known) if len(known) == len(lps) else None,
            "raw_logprob": sum(raw) if len(raw) == len(mine) else None,
            "min_prob": min(math.exp(lp) for lp in known) if known else None,
        })  # fmt: skip
    return out
