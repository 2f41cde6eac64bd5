"""The stability ledger as one self-contained HTML file, no script: the text shaded by risk with
the flagged tokens marked, margin against noise per step (SVG), a table per variant and each
variant's change of the reference tokens' logprobs. Model text goes through Jinja's autoescape."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from markupsafe import Markup

from lmtrace.files import write_atomic
from lmtrace.render.html.kvlab import delta_colour
from lmtrace.render.html.templating import env
from lmtrace.render.plots.trace import PALETTE

WIDTH, HEIGHT, PAD = 760, 240, 44
FLOOR = 1e-7  # the plot's lowest value: float32 rounding of a logprob


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def risk_colour(step: dict[str, Any], threshold: float) -> str:
    """Red where flagged; orange fading to nothing as the risk rises to 10 x the threshold."""
    if step["flagged"]:
        return "rgba(220,38,38,0.85)"
    risk = step.get("risk")
    if risk is None or risk >= 10 * threshold:
        return "transparent"
    a = 0.55 * (1 - math.log10(risk / threshold))  # 0.55 at the threshold, 0 at ten times it
    return f"rgba(234,88,12,{max(0.0, a):.3f})"


def _token_title(row: dict[str, Any]) -> str:
    flips = ", ".join(row["flipped_in"]) or "none"
    return (
        f"step {row['index']}: margin {_fmt(row['margin'], '.3g')} over {row['runner_up']!r}, sigma "
        f"{_fmt(row['sigma'], '.2g')}, risk {_fmt(row['risk'], '.3g')}; flipped under: {flips}"
    )


def _log_y(v: float, low: float, high: float) -> float:
    v = min(max(v, low), high)
    frac = (math.log10(v) - math.log10(low)) / (math.log10(high) - math.log10(low))
    return HEIGHT - 22 - (HEIGHT - 34) * frac


def margin_svg(steps: list[dict[str, Any]], threshold: float) -> Markup:
    """Per step (x): the margin (dots, red where flagged) and threshold x sigma (line), log y."""
    values = [s["margin"] for s in steps if s["margin"]] + [threshold * s["sigma"] for s in steps if s["sigma"]]
    high = 10 ** math.ceil(math.log10(max(values, default=1.0)))
    low = max(FLOOR, 10 ** math.floor(math.log10(min(values, default=FLOOR))))
    high = max(high, low * 10)
    n = len(steps)
    x = lambda i: PAD + (WIDTH - PAD - 10) * (i / max(1, n - 1))  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">']
    exponent = int(math.log10(low))
    while 10**exponent <= high * 1.001:
        y = _log_y(10**exponent, low, high)
        parts.append(
            f'<line x1="{PAD}" y1="{y:.1f}" x2="{WIDTH}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="2" y="{y + 4:.1f}" font-size="10">1e{exponent}</text>'
        )
        exponent += 1
    line = [f"{x(i):.1f},{_log_y(threshold * s['sigma'], low, high):.1f}" for i, s in enumerate(steps) if s["sigma"]]
    parts.append(f'<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="{" ".join(line)}"/>')
    for i, s in enumerate(steps):
        if s["margin"] is None:
            continue
        fill = "#dc2626" if s["flagged"] else "#111"
        parts.append(
            f'<circle cx="{x(i):.1f}" cy="{_log_y(max(s["margin"], low), low, high):.1f}" r="3" '
            f'fill="{fill}"><title>step {i}: margin {s["margin"]:.3g}</title></circle>'
        )
    parts.append(f'<text x="{WIDTH - 60}" y="{HEIGHT - 4}" font-size="11">step {n - 1}</text></svg>')
    return Markup("".join(parts))


def _variant_view(v: dict[str, Any], ref_steps: list[dict[str, Any]], colour: str) -> dict[str, Any]:
    t = v.get("timing") or {}
    tokens = []
    for step, ref in zip(v["steps"], ref_steps):
        title = (
            f"step {step['index']}: logprob {_fmt(step['logprob'], '.4f')} (reference {ref['logprob']:.4f}, "
            f"Δ {_fmt(step['delta'], '+.2e')})" + (", top-1 flipped" if step["flipped"] else "")
        )
        tokens.append(
            {"text": ref["text"], "colour": delta_colour(step["delta"]), "title": title, "flipped": step["flipped"]}
        )
    div = v["first_divergence"]
    own = None
    if div is not None and v.get("token_ids") is not None:
        own = v["text"]
    return {
        "variant": v["variant"],
        "colour": colour,
        "status": v["status"],
        "reason": v["reason"],
        "about": v["about"],
        "flips": v["flips"],
        "max": _fmt(v["max_abs_delta"], ".2e"),
        "mean": _fmt(v["mean_abs_delta"], ".2e"),
        "divergence": "never" if div is None else f"step {div}",
        "own": own,
        "tokens": tokens,
        "seconds": f"{sum(t.get(k, 0.0) for k in ('build_ms', 'forced_ms', 'decode_ms')) / 1000:.1f}",
    }


def render_stability_html(result: Any) -> str:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    ref, threshold = d["reference"], d["threshold"]
    text = [
        {
            "text": s["text"],
            "colour": risk_colour(row, threshold),
            "title": _token_title(row),
            "flagged": row["flagged"],
        }
        for s, row in zip(ref["steps"], d["steps"])
    ]
    variants = [_variant_view(v, ref["steps"], PALETTE[i % len(PALETTE)]) for i, v in enumerate(d["variants"])]
    return (
        env()
        .get_template("stability.html.j2")
        .render(
            model=(ref.get("model") or {}).get("source", ""),
            prompt=ref["prompt"]["text"],
            prompt_tokens=len(ref["prompt"]["token_ids"]),
            steps=len(ref["steps"]),
            threshold=threshold,
            text=text,
            flagged=[s for s in d["steps"] if s["flagged"]],
            margin_svg=margin_svg(d["steps"], threshold),
            variants=variants,
            runs=d.get("runs") or [],
            fmt=_fmt,
        )
    )


def write_stability_html(path: str | Path, result: Any) -> None:
    write_atomic(path, render_stability_html(result))
