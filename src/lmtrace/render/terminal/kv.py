"""Terminal views of the KV cache: its anatomy, its size per step with a chart, the size
calculator's table, and the two loops of the misuse demo."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from lmtrace.render.tokens import human

BARS = " ▁▂▃▄▅▆▇█"


def anatomy_view(an: dict[str, Any], model: str, positions: int | None = None, measured: int | None = None) -> Group:
    """Each dimension with its value and config field, the formula with its numbers and result."""
    from lmtrace.render.anatomy import terminal

    return terminal(an, model, positions, measured)


def chart(values: list[int], width: int = 60, height: int = 6) -> Text:
    """A small bar chart of `values` over steps, drawn with block characters."""
    if not values:
        return Text()
    if len(values) > width:  # sample evenly so the chart fits
        values = [values[i * len(values) // width] for i in range(width)]
    top = max(values) or 1
    rows = []
    for level in range(height, 0, -1):
        line = ""
        for v in values:
            filled = v / top * height - (level - 1)
            line += BARS[max(0, min(8, round(filled * 8)))]
        rows.append(line)
    label = human(top)  # the top's label in a gutter, its tick on the axis the bars stand on
    out = Text()
    for k, r in enumerate(rows):
        out.append(f"{label} ┤" if k == 0 else " " * len(label) + " │", style="dim")
        out.append(r + "\n", style="magenta")
    out.append(" " * (len(label) - 1) + "0 └" + "─" * len(values) + " step\n", style="dim")
    return out


def steps_view(steps: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("step", "seq_len", "bytes", "growth", "layers × (batch, kv_heads, seq_len, head_dim)"):
        table.add_column(name, justify="right" if name != "layers × (batch, kv_heads, seq_len, head_dim)" else "left")
    previous = None
    for i, kv in enumerate(steps):
        growth = "" if previous is None else f"+{human(kv['bytes'] - previous)}"
        layers = kv.get("layers") or []
        shapes = Counter(tuple(x["keys"]) for x in layers if x.get("keys"))  # layers per shape
        shape_text = ", ".join(f"{n} × {list(s)}" for s, n in sorted(shapes.items()))
        table.add_row(str(i), str(kv["seq_len"]), human(kv["bytes"]), growth, shape_text)
        previous = kv["bytes"]
    return table


def size_view(d: dict[str, Any]) -> Group:
    from lmtrace.render.anatomy import title

    head = Text()
    full = d.get("bytes_per_token_full", d["bytes_per_token"])
    if full != d["bytes_per_token"]:  # sliding layers: they stop growing once their window is full
        head.append(
            f"{human(d['bytes_per_token'])} per token while the windows fill, then {human(full)} per token "
            f"({d['dtype']}); +{human(d.get('growth_at_context', full))} per token at context {d['context']}; "
        )
    else:
        head.append(f"{human(d['bytes_per_token'])} per token ({d['bytes_per_token']} bytes, {d['dtype']}); ")
    head.append(f"{human(d['total_bytes'])} at context {d['context']} × batch {d['batch']}", style="bold")
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("context", justify="right")
    table.add_column(f"batch {d['batch']}", justify="right")
    for row in d["table"]:
        table.add_row(f"{row['context']:,}", human(row["bytes"] * d["batch"]))
    return Group(title(f"{d['model']}:", ""), Padding(head, (0, 0, 0, 2)), Text(), table)


def misuse_view(d: dict[str, Any]) -> Group:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("round", "right: fed", "right: cache", "mistake: fed", "mistake: cache", "max |Δlogit|", "same token"):
        table.add_column(name, justify="right")
    for r in d["rounds"]:
        table.add_row(
            str(r["round"]),
            str(r["correct_input_len"]),
            str(r["correct_cache_len"]),
            str(r["refeed_input_len"]),
            Text(str(r["refeed_cache_len"]), style="red" if r["round"] else ""),
            f"{r['max_logit_diff']:.3g}",
            "yes" if r["same_token"] else Text("no", style="red"),
        )
    n = d["prompt_len"]
    note = Text(
        f"prompt of n = {n} tokens: the right loop's cache holds n + k positions after round k; the mistaken "
        f"loop's holds (k+1)·n + k(k+1)/2.\n"
    )
    problems = Text()
    for m in d["refeed_problems"][:1]:
        problems.append("watch: " + m + "\n", style="yellow")
    problems.append(f"watch on the right loop: {len(d['correct_problems'])} problems\n", style="green")
    return Group(note, table, Text(), problems)
