"""The KV cache's anatomy as a person reads it, for the HTML report and the terminal: each
dimension with its value and the config field it comes from, the formula with the numbers
filled in and its result, "none" where a list is empty, and an alert only when the measured
cache differed from the formula. Input: the anatomy dict of a trace (`kv_anatomy`, from
lmtrace.kv.size.Anatomy.to_dict, plus `mismatches`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from markupsafe import Markup
from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from lmtrace.render.tokens import human


@dataclass
class Dimension:
    name: str
    value: str
    source: str  # the config field(s) the value comes from, or what it counts


def _field(source: str | None, value: Any) -> str:
    """'num_hidden_layers = 30' -> 'num_hidden_layers'; 'head_dim = hidden_size / num_attention_heads
    = 576 / 9 = 64' -> 'hidden_size / num_attention_heads = 576 / 9'."""
    if not source:
        return ""
    text = source.removeprefix("head_dim = ")
    if text.startswith(f"{value} "):  # 'head_dim = 64 (explicit; ...)'
        return "head_dim" + text[len(str(value)) :]
    return text.replace(f" = {value}", "", 1)


def listed(values: list[Any] | None) -> str:
    """'none' for an empty list, else the items joined by commas."""
    return ", ".join(str(v) for v in values) if values else "none"


def dimensions(an: dict[str, Any], positions: int | None = None) -> list[Dimension]:
    src = an.get("sources") or {}
    heads, kv_heads = an.get("attention_heads"), an.get("kv_heads")
    rows = [
        Dimension("layers", str(an.get("layers")), _field(src.get("layers"), an.get("layers"))),
        Dimension(
            "KV heads",
            str(kv_heads),
            _field(src.get("kv_heads"), kv_heads)
            + (f"; {heads} query heads share them: {an.get('attention')}" if heads != kv_heads else ""),
        ),
        Dimension("head_dim", str(an.get("head_dim")), _field(src.get("head_dim"), an.get("head_dim"))),
        Dimension("batch", str(an.get("batch")), src.get("batch", "sequences decoded together")),
    ]
    sliding = an.get("sliding_layers") or []
    if positions is not None:
        counted = "prompt tokens + generated tokens" + (" (at most window − 1 on a sliding layer)" if sliding else "")
        rows.append(Dimension("positions", str(positions), counted))
    rows.append(Dimension("bytes per element", str(an.get("bytes_per_element")), f"dtype {an.get('dtype')}"))
    if not sliding:
        rows.append(Dimension("sliding-window layers", "none", "every layer keeps every position"))
        return rows
    windows = [w for w in an.get("windows") or [] if w]
    held = ", ".join(str(int(w) - 1) for w in windows)
    rows.append(
        Dimension(
            "sliding-window layers",
            f"{len(sliding)} of {an.get('layers')}",
            f"layers {spans(sliding)}; window {listed(windows)}: they hold window − 1 = {held} positions",
        )
    )
    return rows


def spans(indices: list[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> '0–2, 4, 6–7'."""
    out: list[str] = []
    for i in sorted(indices):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in out)  # type: ignore[misc]


def groups(an: dict[str, Any]) -> list[dict[str, Any]]:
    """The layer groups of the anatomy ({kind, window, kv_heads, head_dim, layers}); older records
    without them: the full layers and one group per window, from `sliding_layers` and `windows`."""
    if an.get("groups"):  # full layers first, then the sliding ones, as the formula reads
        return sorted(an["groups"], key=lambda g: bool(g.get("window")))
    layers, sliding = int(an.get("layers") or 0), list(an.get("sliding_layers") or [])
    shape = {"kv_heads": an.get("kv_heads"), "head_dim": an.get("head_dim")}
    out = []
    full = [i for i in range(layers) if i not in sliding]
    if full:
        out.append({"kind": "full_attention", "window": None, "layers": full, **shape})
    windows = an.get("windows") or []
    if sliding and len(windows) == 1:
        out.append({"kind": "sliding_window", "window": int(windows[0]), "layers": sliding, **shape})
    return out


def held(group: dict[str, Any], positions: int) -> int:
    """Positions a layer of `group` keeps after `positions` tokens (transformers keeps window − 1)."""
    return min(positions, int(group["window"]) - 1) if group.get("window") else positions


@dataclass
class Formula:
    symbols: str  # the formula in words
    numbers: str  # the same with the numbers filled in
    result: str  # what it comes to
    per_position: str
    measured: str | None  # the ledger's measured bytes, when known


def formula(an: dict[str, Any], positions: int | None = None, measured: int | None = None) -> Formula:
    per_position = int(an.get("bytes_per_token") or 0)
    head = [2, an.get("kv_heads"), an.get("head_dim"), an.get("bytes_per_element")]
    layers = int(an.get("layers") or 0)
    seen = None if measured is None else f"{measured:,} bytes ({human(measured)})"
    parts = groups(an)
    per_line = growth_line(an, parts, positions)
    if positions is None:
        symbols = "bytes per position = 2 (keys and values) × layers × KV heads × head_dim × bytes per element"
        numbers = " × ".join(str(f) for f in [2, layers, *head[1:]])
        return Formula(symbols, numbers, f"{per_position:,} bytes ({human(per_position)})", per_line, seen)
    if any(g.get("window") for g in parts):
        return _windowed(an, parts, positions, per_line, seen)
    batch = int(an.get("batch") or 1)
    symbols = "bytes = 2 (keys and values) × layers × KV heads × head_dim × bytes per element × batch × positions"
    numbers = " × ".join(str(f) for f in [2, layers, *head[1:], batch, positions])
    total = per_position * batch * positions
    return Formula(symbols, numbers, f"{total:,} bytes ({human(total)})", per_line, seen)


def _windowed(
    an: dict[str, Any], parts: list[dict[str, Any]], positions: int, per_line: str, seen: str | None
) -> Formula:
    """One term per group of layers: full layers × positions + sliding layers × min(positions,
    window − 1); KV heads and head_dim factored out where every layer shares them."""
    batch, bpe = int(an.get("batch") or 1), int(an.get("bytes_per_element") or 0)
    words = " + ".join(
        "sliding layers × min(positions, window − 1)" if w else "full layers × positions"
        for w in sorted({bool(g.get("window")) for g in parts})
    )
    terms = [f"{len(g['layers'])} × {held(g, positions)}" for g in parts]
    if all((g["kv_heads"], g["head_dim"]) == (an.get("kv_heads"), an.get("head_dim")) for g in parts):
        symbols = f"bytes = 2 (keys and values) × KV heads × head_dim × bytes per element × batch × ({words})"
        numbers = " × ".join(str(f) for f in [2, an.get("kv_heads"), an.get("head_dim"), bpe, batch])
        numbers += " × (" + " + ".join(terms) + ")"
    else:
        symbols = f"bytes = 2 (keys and values) × bytes per element × batch × Σ KV heads × head_dim × ({words})"
        numbers = (
            f"2 × {bpe} × {batch} × ("
            + " + ".join(f"{g['kv_heads']} × {g['head_dim']} × {t}" for g, t in zip(parts, terms))
            + ")"
        )
    total = 2 * bpe * batch * sum(g["kv_heads"] * g["head_dim"] * len(g["layers"]) * held(g, positions) for g in parts)
    return Formula(symbols, numbers, f"{total:,} bytes ({human(total)})", per_line, seen)


def growth_line(an: dict[str, Any], parts: list[dict[str, Any]], positions: int | None) -> str:
    """How much one sequence's cache grows per token: on a model with sliding layers, the growth
    while the windows fill and after (only the full layers grow), and the growth now."""
    per_position = int(an.get("bytes_per_token") or 0)
    line = f"{human(per_position)} per token ({per_position:,} bytes per position of one sequence)"
    windows = sorted(int(g["window"]) for g in parts if g.get("window"))
    if not windows:
        return line
    bpe = int(an.get("bytes_per_element") or 0)
    full = sum(2 * g["kv_heads"] * g["head_dim"] * len(g["layers"]) for g in parts if not g.get("window")) * bpe
    line = (
        f"{human(per_position)} per token while the windows fill (up to {windows[-1] - 1:,} positions), then "
        f"{human(full)} per token ({full:,} bytes: only the full-attention layers grow)"
    )
    if positions is not None:
        now = (
            2
            * bpe
            * sum(
                g["kv_heads"] * g["head_dim"] * len(g["layers"])
                for g in parts
                if held(g, positions) > held(g, positions - 1)
            )
        )
        line += f"; at {positions:,} positions: +{human(now)} per token"
    return line


def alert(an: dict[str, Any]) -> str | None:
    """A line when the measured cache differed from the formula at some steps, else None."""
    steps = an.get("mismatches")
    if not steps:
        return None
    return f"The measured KV cache differs from the formula at step{'s' if len(steps) > 1 else ''} {listed(steps)}"


def shape_line(an: dict[str, Any], positions: int | None) -> str:
    seq = positions if positions is not None else "seq_len"
    head = "keys and values, each (batch, KV heads, positions, head_dim)"
    parts = groups(an)
    if not any(g.get("window") for g in parts):
        return f"{head} = ({an.get('batch')}, {an.get('kv_heads')}, {seq}, {an.get('head_dim')}) per layer"
    shapes = []
    for g in parts:
        kept = (
            held(g, positions)
            if positions is not None
            else (f"min(seq_len, {int(g['window']) - 1})" if g.get("window") else "seq_len")
        )
        kind = "sliding" if g.get("window") else "full"
        n = len(g["layers"])
        shapes.append(
            f"{n} {kind} layer{'s' if n > 1 else ''} ({an.get('batch')}, {g['kv_heads']}, {kept}, {g['head_dim']})"
        )
    return f"{head}: " + ", ".join(shapes)


def html(an: dict[str, Any], positions: int | None = None, measured: int | None = None) -> Markup:
    """The anatomy block of the report's KV section (every value escaped)."""
    if "unsupported" in an:
        return Markup('<p class="anatomy-note">{}</p>').format(an["unsupported"])
    out = Markup('<div class="anatomy">')
    warning = alert(an)
    if warning:
        out += Markup('<p class="error anatomy-alert" role="alert">{}</p>').format(warning)
    out += Markup('<p class="anatomy-shape">{}</p>').format(shape_line(an, positions))
    rows = Markup("").join(
        Markup("<tr><th>{}</th><td>{}</td><td>{}</td></tr>").format(d.name, d.value, d.source)
        for d in dimensions(an, positions)
    )
    out += Markup(
        '<table class="anatomy-dims"><thead><tr><th>dimension</th><th>value</th><th>from the config</th></tr>'
        "</thead><tbody>{}</tbody></table>"
    ).format(rows)
    f = formula(an, positions, measured)
    lhs, rhs = f.symbols.split(" = ", 1)
    lines = [(lhs, rhs), ("", f.numbers), ("", f.result)]
    body = Markup("").join(Markup("<div><span>{}</span><code>= {}</code></div>").format(a, b) for a, b in lines)
    out += Markup('<div class="anatomy-formula">{}</div>').format(body)
    notes = [f.per_position] + ([f"measured after the last step: {f.measured}"] if f.measured else [])
    out += Markup('<p class="anatomy-note">{}</p>').format("; ".join(notes))
    return out + Markup("</div>")


def terminal(an: dict[str, Any], model: str, positions: int | None = None, measured: int | None = None) -> Group:
    """The same reading for `lmtrace cache` and `lmtrace kv-size`, laid out for any width: a long
    line wraps under its own start (a dimension's source under the sources, the formula under
    its "="), never back to column 0."""
    rows: list[Any] = [title("KV cache of", model)]
    warning = alert(an)
    if warning:
        rows.append(_indented(Text(f"error: {warning}", style="bold red")))
    rows.append(_indented(Text(shape_line(an, positions))))
    dims = Table.grid(padding=(0, 2))
    dims.add_column(style="cyan", no_wrap=True)
    dims.add_column(justify="right", style="bold", no_wrap=True)
    dims.add_column(style="dim")
    for d in dimensions(an, positions):
        dims.add_row(d.name, d.value, d.source)
    rows.append(_indented(dims))
    f = formula(an, positions, measured)
    lhs, rhs = f.symbols.split(" = ", 1)
    eq = Table.grid(padding=(0, 1))
    eq.add_column(no_wrap=True)
    eq.add_column()
    eq.add_row(lhs, f"= {rhs}")
    eq.add_row("", f"= {f.numbers}")
    eq.add_row("", Text(f"= {f.result}", style="bold"))
    rows.append(_indented(eq))
    measured_text = f"; measured after the last step: {f.measured}" if f.measured else ""
    rows.append(_indented(Text(f.per_position + measured_text)))
    return Group(*rows)


def title(label: str, name: str) -> Table:
    """'label name' in bold, a long name (a path) wrapping under its own start."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(style="bold", overflow="fold")
    grid.add_row(Text(label), Text(name))  # Text: a name's "[...]" is not markup
    return grid


def _indented(renderable: Any) -> Padding:
    return Padding(renderable, (0, 0, 0, 2))


def last_kv(steps: list[Any]) -> tuple[int | None, int | None]:
    """(positions, measured bytes) of the last step's cache ledger, when recorded."""
    kv = steps[-1].get("kv") if steps and isinstance(steps[-1], dict) else None
    if not isinstance(kv, dict):
        return None, None
    measured = kv.get("bytes_used", kv.get("bytes"))
    return kv.get("seq_len"), measured if isinstance(measured, int) else None
