"""The terminal view of inside a step: one row per layer, the logit lens (what that layer
predicts, the chosen token's probability and rank) beside the attention over the cache (where
that layer looked), and a line of settling layers for the whole trace."""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table
from rich.text import Text

from lmtrace.errors import InvalidParameter
from lmtrace.records import Step, Trace
from lmtrace.render.tokens import colour, escape


def _p(logprob: float | None) -> float | None:
    return None if logprob is None else math.exp(logprob)


def _top1(layer: dict[str, Any]) -> Text:
    top = layer.get("top") or []
    if not top:
        return Text("–")
    p = _p(top[0].get("logprob")) or 0.0
    return Text(f"{escape(top[0].get('text', ''))!r} {_short(p)}")


def _short(x: float) -> str:
    """A share in three characters where it fits 80 columns: .42, 1.0."""
    return f"{x:.2f}".removeprefix("0") if x < 0.995 else "1.0"


def _looked(layer: dict[str, Any] | None) -> str:
    if not layer or not layer.get("top"):
        return "–"
    t = layer["top"][0]
    return f"{t['position']} {escape(t.get('text', ''))!r} {_short(t['weight'])}"


def _looks_at(layer: dict[str, Any] | None) -> str:
    """The most attended position, value-weighted where recorded (what the layer read)."""
    if layer is None:
        return "–"
    return _looked(layer.get("value_weighted") or layer)


def inside_table(step: Step, positions: int | None = None, recent: int = 32) -> Table:
    """A row per layer (final layer first): lens columns where the step has a lens (top-1 with
    its probability, the chosen token's probability and rank, entropy, KL to the final layer),
    attention columns where it has attention (the most attended position, value-weighted where
    recorded; the raw sink mass; the last-`recent` mass only when the step's query sees more than
    `recent` positions; the attention entropy). Layer n is the lens's row n and decoder layer n
    (0: the embeddings), the one numbering of layers in every view."""
    lens = {x["layer"]: x for x in (step.lens or {}).get("layers") or []}
    att = {x["layer"] + 1: x for x in (step.attention or {}).get("layers") or []}  # decoder layer i -> row i+1
    settled = (step.lens or {}).get("settled_at")
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
    where = f", settled at layer {settled}" if step.lens else ""
    table.title = Text(f"step {step.index}: {escape(step.text)!r}{where}")
    longer = positions is not None and positions > recent
    table.caption_justify = "left"
    if step.attention:  # two short lines: a long caption would wrap back to the table's first column
        valued = any("value_weighted" in x for x in att.values())
        table.caption = Text(
            "layer n: decoder layer n's output (0: the embeddings)\np, rank: the chosen token's; "
            + ("looks at: value-weighted\n" if valued else "")
            + "sinks: the raw mass on the first 4"
        )
    right = {"no_wrap": True, "justify": "right"}
    table.add_column("layer", **right)
    if step.lens:
        for name in ("top-1", "p", "rank", "H", "KL"):
            table.add_column(name, **(right if name != "top-1" else {"no_wrap": True, "overflow": "ellipsis"}))
    if step.attention:
        table.add_column("looks at", no_wrap=True, overflow="ellipsis")
        for name in ("sinks", *([f"last{recent}"] if longer else []), "att H"):
            table.add_column(name, **right)
    for n in sorted(set(lens) | set(att), reverse=True):
        row: list[Any] = [f"{n}{' ✓' if n == settled else ''}"]
        if step.lens:
            x = lens.get(n, {})
            p = _p(x.get("chosen_logprob"))
            shown = Text(f"{p:.3f}", style=colour(p)) if p is not None else Text("–")
            row += [
                _top1(x),
                shown,
                str(x.get("chosen_rank", "–")),
                f"{x.get('entropy', 0):.2f}",
                f"{x.get('kl_to_final', 0):.1f}",
            ]
        if step.attention:
            a = att.get(n)
            keys = ("sink_mass", *(["recent_mass"] if longer else []), "entropy")
            masses = ["–"] * len(keys) if a is None else [f"{a[k]:.2f}" for k in keys]
            row += [_looks_at(a), *masses]
        table.add_row(*row)
    return table


def settled_line(trace: Trace) -> Table:
    """The settling layer of every step (– where the final top-1 is not the chosen token); a long
    list wraps under itself, not back to column 0."""
    found = [s.lens.get("settled_at") for s in trace.steps if s.lens]
    shown = ", ".join("–" if x is None else str(x) for x in found)
    line = Table.grid(padding=(0, 1))
    line.add_column(no_wrap=True)
    line.add_column()
    line.add_row("logit lens: settled at layer", f"{shown} (of {_layers(trace)}; 0 = embeddings)")
    return line


def _layers(trace: Trace) -> int:
    first = next((s.lens for s in trace.steps if s.lens), None)
    return len(first["layers"]) - 1 if first else 0


def pick_step(trace: Trace, index: int | None) -> Step:
    """The step to show: `index`, or the first one; named errors for a trace without records."""
    if not any(s.lens or s.attention for s in trace.steps):
        which = "lens" if index is None else "step"
        raise InvalidParameter(
            f"{which}: this trace has no lens or attention records (generate with --lens or --attention)"
        )
    at = 0 if index is None else index
    if not 0 <= at < len(trace.steps):
        raise InvalidParameter(f"step must be in 0..{len(trace.steps) - 1}, got {at}")
    return trace.steps[at]
