"""Structured output in the terminal: each JSON value's confidence (weakest first), each choice's
exact probability, and the steps where the grammar, not the model, chose (it removed more than
half of the raw probability). The rules the HTML report shares (`FLAG`, `flagged`,
`weakest_first`) live here too. Records in, text out: no torch."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from lmtrace.records import Trace
from lmtrace.render.tokens import colour, escape
from lmtrace.render.views import GRAMMAR_FLAG

# a step where the grammar removed more than this share of the raw probability is flagged
FLAG = GRAMMAR_FLAG


def flagged(steps: Iterable[tuple[int, dict[str, Any] | None]]) -> list[tuple[int, float]]:
    """(step index, removed mass) of the steps whose grammar removed more than FLAG of the raw
    mass, from (index, the step's `grammar` record) pairs."""
    return [(i, g["removed_mass"]) for i, g in steps if g and (g.get("removed_mass") or 0.0) > FLAG]


def weakest_first(fields: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fields ordered by their probability under the constraint, least sure first."""
    return sorted(fields, key=lambda f: math.inf if f.get("logprob") is None else f["logprob"])


def probability(logprob: float | None) -> float | None:
    return None if logprob is None else math.exp(logprob)


def shown(p: float | None) -> str:
    """A probability in a table: three decimals, or two significant digits below 0.001."""
    return "–" if p is None else f"{p:.3f}" if p >= 1e-3 or p == 0 else f"{p:.1e}"


def _cell(p: float | None) -> Text:
    return Text(shown(p), style=colour(p or 0.0))


def fields_table(fields: list[dict[str, Any]], width: int = 100) -> Table:
    """One row per value, weakest first: its path, text, probability under the constraint and
    under the raw model, its least likely token, and the steps that wrote it."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    fixed = {"no_wrap": True, "justify": "right"}
    table.add_column("path", no_wrap=True, overflow="ellipsis", max_width=max(12, width // 4))
    table.add_column("value", no_wrap=True, overflow="ellipsis", max_width=max(12, width // 3))
    table.add_column("p", **fixed)
    table.add_column("raw p", **fixed)
    table.add_column("min token p", **fixed)
    table.add_column("steps", **fixed)
    for f in weakest_first(fields):
        p = probability(f.get("logprob"))
        table.add_row(
            f["path"],
            Text(escape(f["text"]), style=colour(p or 0.0)),
            _cell(p),
            _cell(probability(f.get("raw_logprob"))),
            _cell(f.get("min_prob")),
            f"{f['start_step']}–{f['end_step']}" if f["end_step"] != f["start_step"] else str(f["start_step"]),
        )
    return table


def choices_table(choices: list[dict[str, Any]], chosen: str) -> Table:
    """Each option's exact probability under the constraint (summed over its tokenizations)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("option", no_wrap=True, overflow="ellipsis", max_width=40)
    table.add_column("p", no_wrap=True, justify="right")
    table.add_column("tokenizations", no_wrap=True, justify="right")
    for c in sorted(choices, key=lambda c: -(probability(c["logprob"]) or 0.0)):
        mark = " ◀" if c["text"] == chosen else ""
        table.add_row(
            Text(escape(c["text"]) + mark, style="bold" if mark else ""),
            _cell(probability(c["logprob"])),
            str(c["tokenizations"]),
        )
    return table


def grammar_line(trace: Trace) -> Text | None:
    """The steps where the grammar removed more than half of the raw mass, in one line."""
    constrained = [s for s in trace.steps if s.grammar]
    if not constrained:
        return None
    found = flagged((s.index, s.grammar) for s in constrained)
    out = Text(f"grammar ({_constraint(trace.params)}): ", style="bold")
    if not found:
        return out.append("it removed at most half of the raw probability at every step", style="")
    shown = ", ".join(f"{i} ({m:.0%})" for i, m in found[:12]) + (" …" if len(found) > 12 else "")
    out.append(f"it removed more than half of the raw probability at {len(found)} of {len(constrained)} steps — ")
    return out.append(f"the grammar chose there, not the model: {shown}", style="magenta")


def _constraint(params: dict[str, Any]) -> str:
    return next((k for k in ("json_schema", "regex", "choice", "grammar") if params.get(k)), "constraint")


def structured_view(trace: Trace, width: int = 100) -> Group | None:
    """Everything the terminal shows of a constrained trace (None for an unconstrained one)."""
    parts: list[Any] = []
    line = grammar_line(trace)
    if line is not None:
        parts += [Text(), line]
    if trace.fields:
        title = Text("fields, least sure first", style="bold")
        title.append(" (p: the value's probability under the constraint, its tokens' product)", style="dim")
        parts += [Text(), title, fields_table(trace.fields, width)]
    if trace.choices:
        title = Text("choices", style="bold").append(" (p: summed over every tokenization)", style="dim")
        parts += [Text(), title, choices_table(trace.choices, trace.text)]
    return Group(*parts) if parts else None
