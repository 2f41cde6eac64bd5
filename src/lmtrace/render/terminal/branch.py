"""The terminal view of branches (rich): the decodings side by side, the shared prefix dim and
each branch's own text from the branch point on coloured by probability, underlined where it
first differs from the original; below each, the cumulative logprob."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from lmtrace.records import Trace
from lmtrace.render.terminal.trace import legend
from lmtrace.render.tokens import colour, escape, prob, show_bytes


def _diverges(trace: Trace, original: Trace) -> int | None:
    """The first step whose token differs from the original's (None: the same tokens)."""
    for i, s in enumerate(trace.steps):
        if i >= len(original.steps) or s.token_id != original.steps[i].token_id:
            return i
    return None if len(trace.steps) == len(original.steps) else len(trace.steps)


def branch_text(trace: Trace, at: int, original: Trace) -> Text:
    split = _diverges(trace, original)
    out = Text()
    for i, s in enumerate(trace.steps):
        if i < at:
            out.append(s.text, style="dim")
            continue
        style = colour(prob(s.logprob))
        out.append(s.text or ("…" if i == split else ""), style=f"{style} underline" if i == split else style)
    return out


def _label(trace: Trace, rank: int | None, at: int) -> Text:
    if rank is None:
        return Text("original", style="bold")
    if at >= len(trace.steps):
        return Text(f"#{rank}", style="bold")
    s = trace.steps[at]
    return Text(f"#{rank} {show_bytes(s.bytes)!r} p={prob(s.logprob):.3f}", style="bold")


def _total(trace: Trace) -> str:
    return f"{math.fsum(s.logprob for s in trace.steps):.3f} over {len(trace.steps)} tokens"


def view(branches: Any) -> Group:
    """`branches` is a lmtrace.branch.Branches (not imported: renderers need no torch)."""
    original = branches.traces[0]
    head = Text()
    head.append(original.model["source"], style="bold")
    head.append(f"  branching at step {branches.at}", style="dim")
    if branches.at < len(original.steps):
        head.append(f" (the original chose {escape(original.steps[branches.at].text) or '…'!r})", style="dim")
    table = Table(box=None, pad_edge=False, header_style="bold", show_lines=False, expand=True)
    for trace, rank in zip(branches.traces, branches.alternatives):
        table.add_column(_label(trace, rank, branches.at), ratio=1, overflow="fold")
    table.add_row(*(Text(original.prompt["text"], style="dim") for _ in branches.traces))
    table.add_row(*(branch_text(t, branches.at, original) for t in branches.traces))
    table.add_row(*(Text(f"logprob {_total(t)}", style="dim") for t in branches.traces))
    table.add_row(*(Text(f"finish: {t.finish_reason}", style="dim") for t in branches.traces))
    return Group(head, Text(), legend(), Text(), table)


def print_branches(branches: Any, console: Console | None = None) -> None:
    (console or Console()).print(view(branches))
