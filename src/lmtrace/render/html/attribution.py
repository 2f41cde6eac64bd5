"""Attribution in the HTML report: the page script's data for one step (the parts largest
first, each layer's heads for the panel's expandable rows) and a layer × step heatmap of the
attention and MLP parts, side by side, coloured from red (pushes toward the other token) to
green (toward the chosen one). Reads record dicts only: no torch here."""

from __future__ import annotations

import math
from typing import Any

from markupsafe import Markup, escape

from lmtrace.render.terminal.attribution import layer_of, ranked
from lmtrace.render.tokens import escape as visible

LEFT, TOP, GAP, BOTTOM = 40, 30, 16, 22


def _r(x: Any) -> Any:
    return float(f"{x:.4g}") if isinstance(x, float) and math.isfinite(x) else x


def attribution_view(a: dict[str, Any]) -> dict[str, Any]:
    """{against, diff, parts: [[component, value]] largest |value| first, heads: {layer: [[head,
    value]] largest first}} for the panel."""
    heads: dict[str, list] = {}
    for h in sorted(a.get("heads") or [], key=lambda h: -abs(h["value"])):
        heads.setdefault(str(h["layer"]), []).append([h["head"], _r(h["value"])])
    return {
        "against": visible(a.get("against_text", "")),
        "against_id": a.get("against_token_id"),
        "diff": _r(a.get("logit_diff")),
        "parts": [[p["component"], _r(p["value"])] for p in ranked(a)],
        "heads": heads,
    }


def colour(value: float, top: float) -> str:
    """Green toward the chosen token, red toward the other, full colour at |value| = top."""
    if top <= 0:
        return "#f4f4f5"
    a = min(1.0, abs(value) / top)
    return f"rgba(22,163,74,{a:.3f})" if value >= 0 else f"rgba(220,38,38,{a:.3f})"


def _grid(steps: list[dict[str, Any]]) -> tuple[int, dict[tuple[str, int, int], float]]:
    """(layers, {(kind, layer, step): value}) over the steps that carry attribution."""
    cells: dict[tuple[str, int, int], float] = {}
    layers = 0
    for i, s in enumerate(steps):
        for p in (s.get("attribution") or {}).get("parts") or []:
            layer = layer_of(p["component"])
            if layer is not None:
                cells[(p["component"].rsplit(".", 1)[1], layer, i)] = p["value"]
                layers = max(layers, layer + 1)
    return layers, cells


def attribution_heatmap(steps: list[dict[str, Any]], view: int = 0) -> Markup | None:
    """Two grids (attention | MLP), a row per decoder layer (the last on top), a column per step;
    each cell's <title> names its step, token, part and value, and selects its step."""
    layers, cells = _grid(steps)
    if not layers:
        return None
    n = len(steps)
    top = max((abs(v) for v in cells.values()), default=0.0)
    cw = max(3.0, min(20.0, 260 / max(n, 1)))
    ch = max(5.0, min(14.0, 300 / layers))
    block = cw * n
    width, height = LEFT + 2 * block + GAP + 8, TOP + ch * layers + BOTTOM
    out = [
        f'<svg class="heatmap" viewBox="0 0 {width:.0f} {height:.0f}" style="max-width: {1.6 * width:.0f}px" '
        'role="img" aria-label="attention and MLP parts of the logit difference per layer and step">',
        f'<text class="tick axis" x="4" y="{TOP - 16}">layer</text>',
    ]
    every = max(1, math.ceil(layers / 6))
    for k in sorted({0, *range(every, layers, every), layers - 1}):
        y = TOP + ch * (layers - 1 - k) + ch * 0.75
        out.append(f'<text class="tick" x="{LEFT - 4}" y="{y:.1f}" text-anchor="end">{k}</text>')
    for b, kind in enumerate(("attn", "mlp")):
        x0 = LEFT + b * (block + GAP)
        out.append(
            f'<text class="tick axis" x="{x0:.1f}" y="{TOP - 6}">{"attention" if kind == "attn" else "MLP"}</text>'
        )
        for (k, layer, i), v in cells.items():
            if k != kind:
                continue
            token = visible(steps[i].get("text", ""))
            title = f"step {steps[i].get('index', i)} {token!r} · L{layer}.{kind}: {v:+.4f}"
            out.append(
                f'<rect class="cell" x="{x0 + cw * i:.1f}" y="{TOP + ch * (layers - 1 - layer):.1f}" '
                f'width="{cw:.1f}" height="{ch:.1f}" fill="{colour(v, top)}" data-v="{view}" data-i="{i}">'
                f"<title>{escape(title)}</title></rect>"
            )
        every_step = max(1, n // 8)
        for i in range(0, n, every_step):
            out.append(
                f'<text class="tick" x="{x0 + cw * (i + 0.5):.1f}" y="{height - BOTTOM + 12:.0f}" '
                f'text-anchor="middle">{i}</text>'
            )
    out.append("</svg>")
    return Markup("".join(out))


def attribution_note(top: float) -> Markup:
    return Markup(
        "<p class='meta'>Each cell: that layer's attention or MLP share of the logit difference between the "
        "chosen token and the other one (direct logit attribution through the final norm, its scale frozen at the "
        f"step's value). Green pushes toward the chosen token, red toward the other; full colour at ±{top:.3g}. "
        "Click a cell for the step's parts and heads in the panel.</p>"
    )


def heatmap_top(steps: list[dict[str, Any]]) -> float:
    return max((abs(v) for v in _grid(steps)[1].values()), default=0.0)
