"""The terminal view of attribution: a row per step (the chosen token, the other one, the logit
difference and the parts that moved it most), and one step's parts largest first."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from lmtrace.records import Trace
from lmtrace.render.tokens import escape


def ranked(attribution: dict[str, Any], n: int | None = None) -> list[dict[str, Any]]:
    """The parts, largest |value| first (the first n)."""
    parts = sorted(attribution.get("parts") or [], key=lambda p: -abs(p["value"]))
    return parts if n is None else parts[:n]


def head_parts(attribution: dict[str, Any], layer: int) -> list[dict[str, Any]]:
    """A layer's heads (and its projection's bias, head "bias"), largest |value| first."""
    heads = [h for h in attribution.get("heads") or [] if h["layer"] == layer]
    return sorted(heads, key=lambda h: -abs(h["value"]))


def layer_of(component: str) -> int | None:
    """`L12.attn` -> 12; None for embed and the norm's terms."""
    if component.startswith("L") and "." in component:
        head = component[1:].split(".", 1)[0]
        return int(head) if head.isdigit() else None
    return None


def attribution_table(trace: Trace, width: int = 80, top: int = 3) -> Table:
    """One row per step: token, against, logit difference, the `top` largest parts."""
    table = Table(
        box=None,
        pad_edge=False,
        header_style="bold",
        title_justify="left",
        title="attribution: logit(token) − logit(against), the largest parts",
    )
    table.add_column("step", justify="right")
    table.add_column("token")
    table.add_column("against")
    table.add_column("diff", justify="right")
    table.add_column("largest parts", overflow="fold")
    for step in trace.steps:
        a = step.entries.get("attribution")
        if not a:
            continue
        parts = ", ".join(f"{p['component']} {p['value']:+.2f}" for p in ranked(a, top))
        table.add_row(
            str(step.index),
            Text(repr(escape(step.text))),
            Text(repr(escape(a.get("against_text", "")))),
            f"{a['logit_diff']:.3f}",
            parts,
        )
    return table


def parts_table(attribution: dict[str, Any], n: int = 12) -> Table:
    """One step's parts, largest first, each layer's top head beside its attention part."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("component")
    table.add_column("value", justify="right")
    table.add_column("top head", justify="right")
    for p in ranked(attribution, n):
        layer = layer_of(p["component"])
        head = ""
        if layer is not None and p["component"].endswith(".attn"):
            heads = head_parts(attribution, layer)
            head = f"h{heads[0]['head']} {heads[0]['value']:+.3f}" if heads else ""
        table.add_row(p["component"], f"{p['value']:+.4f}", head)
    return table
