"""Inside each step in the HTML report: the logit lens as a layer × step heatmap of the chosen
token's probability per layer (with the settling layer marked), and the prompt + generated text
shaded by the hovered step's attention. Reads record dicts only: no torch here."""

from __future__ import annotations

import math
from typing import Any

from markupsafe import Markup, escape

from lmtrace.render.tokens import SCALE
from lmtrace.render.tokens import escape as visible

# the token colours of report.css (--b0 .. --b4, --bn), inline so the SVG shows in a notebook too
FILLS = ["#a8e0a0", "#d4ecaa", "#fbe59a", "#f8c08a", "#f29a9a"]
NO_DATA = "#e4e4e7"
W, LEFT, TOP, BOTTOM = 560, 44, 20, 22
CELLS_UP_TO = 400  # steps drawn as cells of their own (with a title each); a longer trace's as paths


def bucket(p: float) -> int:
    """The token colour bucket of a probability (as views.bucket)."""
    return next((i for i, (t, _) in enumerate(SCALE) if p >= t), len(SCALE) - 1)


def _p(logprob: float | None) -> float | None:
    return None if logprob is None else math.exp(logprob)


def _r(x: Any, digits: int = 4) -> Any:
    return float(f"{x:.{digits}g}") if isinstance(x, float) and math.isfinite(x) else x


def lens_view(lens: dict[str, Any]) -> dict[str, Any]:
    """The page script's data for one step's lens: per layer the chosen token's probability and
    rank, entropy, KL to the final layer and the top tokens as [text, probability]."""
    layers = [
        {
            "l": x["layer"],
            "p": _r(_p(x.get("chosen_logprob"))),
            "rank": x.get("chosen_rank"),
            "H": _r(x.get("entropy")),
            "kl": _r(x.get("kl_to_final")),
            "top": [[visible(t.get("text", "")), _r(_p(t.get("logprob")))] for t in x.get("top") or []],
        }
        for x in lens.get("layers") or []
    ]
    return {"settled": lens.get("settled_at"), "layers": layers}


def attention_view(attention: dict[str, Any]) -> dict[str, Any]:
    """The page script's data for one step's attention: per layer [position, weight] pairs,
    the sink and recent masses and the entropy (mean over heads), and each head's own where
    recorded (attention="heads")."""
    layers = []
    for x in attention.get("layers") or []:
        layer = {"l": x["layer"], **_att_numbers(x)}
        if isinstance(x.get("value_weighted"), dict):
            layer["vw"] = _att_numbers(x["value_weighted"])
        if x.get("heads"):
            layer["heads"] = [_att_numbers(h) for h in x["heads"]]
        layers.append(layer)
    return {"layers": layers}


def _att_numbers(x: dict[str, Any]) -> dict[str, Any]:
    return {
        "top": [[t["position"], _r(t["weight"])] for t in x.get("top") or []],
        "sink": _r(x.get("sink_mass")),
        "recent": _r(x.get("recent_mass")),
        "H": _r(x.get("entropy")),
    }


def _cell_title(step: int, token: str, layer: dict[str, Any], settled: int | None) -> str:
    top = ", ".join(f"{visible(t.get('text', ''))!r} {_p(t.get('logprob')) or 0:.3f}" for t in layer.get("top") or [])
    p = _p(layer.get("chosen_logprob"))
    mark = (" (embeddings)" if layer["layer"] == 0 else "") + (" · settled here" if settled == layer["layer"] else "")
    chosen = f"{p:.3f}" if p is not None else "–"
    head = f"step {step} {token!r} · layer {layer['layer']}{mark}"
    return f"{head}: p(chosen) {chosen}, rank {layer.get('chosen_rank')}; top: {top}"


def _cell(box: tuple[float, float, float, float], view: int, i: int, layer: dict, title: str, settled: bool) -> str:
    """One cell of the heatmap: `box` its (x, y, width, height), `view` and `i` the step it selects."""
    x, y, cw, ch = box
    p = _p(layer.get("chosen_logprob"))
    fill = FILLS[bucket(p)] if p is not None else NO_DATA
    edge = ' stroke="#1f2328" stroke-width="1.5"' if settled else ""
    return (
        f'<rect class="cell{" settled" if settled else ""}" x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" '
        f'height="{ch:.1f}" fill="{fill}"{edge} data-v="{view}" data-i="{i}" data-l="{layer["layer"]}">'
        f"<title>{escape(title)}</title></rect>"
    )


def _axes(n_layers: int, ch: float, height: float, bottom: float) -> list[str]:
    """The layer axis: its name above the ticks (never on one), 'emb' for the embeddings (row 0),
    then decoder layers up to the final one, as the attention selector numbers them."""
    out = [f'<text class="tick axis" x="4" y="{TOP - 6}">layer</text>']
    every = max(1, math.ceil(n_layers / 6))
    for k in sorted({0, *range(every, n_layers - 1, every), n_layers - 1}):
        y = TOP + ch * (n_layers - 1 - k) + ch * 0.75
        out.append(f'<text class="tick" x="{LEFT - 4}" y="{y:.1f}" text-anchor="end">{"emb" if k == 0 else k}</text>')
    out.append(f'<text class="tick axis" x="{LEFT - 4}" y="{height - bottom + 12:.0f}" text-anchor="end">step</text>')
    return out


def _column_label(x: float, y: float, i: int, token: str, named: bool) -> str:
    """A column's step number, and under it the step's token (rotated) where the columns are few."""
    out = f'<text class="tick" x="{x:.1f}" y="{y:.0f}" text-anchor="middle">{i}</text>'
    if named:
        shown = visible(token)
        shown = shown if len(shown) <= 10 else shown[:9] + "…"
        out += (
            f'<text class="tick token" transform="translate({x + 3:.1f},{y + 6:.0f}) rotate(-60)" '
            f'text-anchor="end">{escape(shown)}</text>'
        )
    return out


def lens_heatmap(steps: list[dict[str, Any]], view: int = 0) -> Markup | None:
    """An SVG heatmap: a column per step (its number and, for up to 40 steps, its token), a row
    per layer (the final layer on top, 'emb' the embeddings at the bottom), each cell coloured
    by the chosen token's probability at that layer; the settling layer outlined. Every cell has
    a <title> (its layer's top tokens) and selects its step in the page."""
    lensed = [s for s in steps if isinstance(s.get("lens"), dict)]
    if not lensed:
        return None
    n_layers = max(len(s["lens"].get("layers") or []) for s in lensed)
    n = len(steps)
    named = n <= 40
    bottom = BOTTOM + (48 if named else 0)
    cw = max(3.0, min(28.0, (W - LEFT - 8) / max(n, 1)))
    ch = max(5.0, min(16.0, 300 / max(n_layers, 1)))
    width, height = LEFT + cw * n + 8, TOP + ch * n_layers + bottom
    # drawn at most 1.6 times its viewBox: a short trace's heatmap is not blown up to the page's width
    out = [
        f'<svg class="heatmap" viewBox="0 0 {width:.0f} {height:.0f}" style="max-width: {1.6 * width:.0f}px" '
        f'role="img" aria-label="chosen token probability per layer and step">'
    ]
    out += _axes(n_layers, ch, height, bottom)
    if n > CELLS_UP_TO:  # drawn at its own size (the figure scrolls); the page finds the cell under the pointer
        out[0] = (
            f'<svg class="heatmap painted" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
            f'height="{height:.0f}" role="img" aria-label="chosen token probability per layer and step" '
            f'data-v="{view}" data-x0="{LEFT}" data-y0="{TOP}" data-cw="{cw:.1f}" data-ch="{ch:.1f}" '
            f'data-steps="{n}" data-layers="{n_layers}">'
        )
        out += _painted(steps, n_layers, cw, ch)
    for i, s in enumerate(steps):
        x = LEFT + cw * i
        lens = s.get("lens") if isinstance(s.get("lens"), dict) else {}
        settled, token = lens.get("settled_at"), s.get("text", "")
        for layer in (lens.get("layers") or []) if n <= CELLS_UP_TO else ():
            y = TOP + ch * (n_layers - 1 - layer["layer"])
            title = _cell_title(s.get("index", i), token, layer, settled)
            out.append(_cell((x, y, cw, ch), view, i, layer, title, settled == layer["layer"]))
        if named or i % max(1, n // 20) == 0:
            out.append(_column_label(x + cw / 2, height - bottom + 12, i, token, named))
    out.append("</svg>")
    return Markup("".join(out))


def _painted(steps: list[dict[str, Any]], n_layers: int, cw: float, ch: float) -> list[str]:
    """A long trace's cells as one path per colour (and one for the settling layers' outlines):
    a few bytes a cell rather than an element with its own title."""
    shapes: dict[str, list[str]] = {}
    box = f"h{cw:.1f}v{ch:.1f}h-{cw:.1f}z"
    for i, s in enumerate(steps):
        lens = s.get("lens") if isinstance(s.get("lens"), dict) else {}
        for layer in lens.get("layers") or []:
            p = _p(layer.get("chosen_logprob"))
            at = f"M{LEFT + cw * i:.1f} {TOP + ch * (n_layers - 1 - layer['layer']):.1f}"
            shapes.setdefault(FILLS[bucket(p)] if p is not None else NO_DATA, []).append(at + box)
            if lens.get("settled_at") == layer["layer"]:
                shapes.setdefault("settled", []).append(at + box)
    out = [f'<path class="cells" fill="{fill}" d="{"".join(d)}"/>' for fill, d in shapes.items() if fill != "settled"]
    if "settled" in shapes:
        out.append(
            f'<path class="settled" fill="none" stroke="#1f2328" stroke-width="1.5" d="{"".join(shapes["settled"])}"/>'
        )
    return out


def positions(d: dict[str, Any], views: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Every position of prompt + generated text as {pos, shown, prompt, sink}, where the trace
    knows its prompt's tokens (recorded with attention); `sink` where the position behaves as one."""
    tokens = (d.get("prompt") or {}).get("tokens")
    if not isinstance(tokens, list):
        return None
    sinks = sink_positions(d.get("steps") or [])
    out = [{"pos": k, "shown": visible(t), "prompt": True} for k, t in enumerate(tokens)]
    out += [{"pos": len(tokens) + k, "shown": v["shown"], "prompt": False} for k, v in enumerate(views)]
    for p in out:
        p["sink"] = p["pos"] in sinks
    return out


SINK_SHARE, SINK_KEEPS = 0.2, 0.8  # a sink: >= 20% of the raw weight, and value weighting takes >= 20% off it


def sink_positions(steps: list[dict[str, Any]]) -> set[int]:
    """The positions that behave as attention sinks: over every step and layer they take at least
    a fifth of the raw attention on average, while value weighting (their values are small) takes
    at least a fifth of that off. Not simply "the first 4": a short prompt's content words are no
    sinks (value weighting raises their share). SmolLM2's first token: 0.58 raw, 0.40 weighted."""
    raw: dict[int, float] = {}
    valued: dict[int, float] = {}
    count = 0
    for s in steps:
        for x in (s.get("attention") or {}).get("layers") or []:
            count += 1
            for t in x.get("top") or []:
                raw[t["position"]] = raw.get(t["position"], 0.0) + t["weight"]
            for t in (x.get("value_weighted") or {}).get("top") or []:
                valued[t["position"]] = valued.get(t["position"], 0.0) + t["weight"]
    if not count or not valued:
        return set()
    return {p for p, w in raw.items() if w / count >= SINK_SHARE and valued.get(p, 0.0) <= SINK_KEEPS * w}
