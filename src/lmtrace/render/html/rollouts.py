"""The rollouts report as one self-contained HTML file, no script: the summary metrics, the
causes with their figures, the TIS/MIS table, a histogram of the log-ratios (SVG), and each
rollout's tokens coloured by |Δ| = |trainer − engine| with the per-token split in a panel.
Model text goes through Jinja's autoescape."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from markupsafe import Markup

from lmtrace.files import write_atomic
from lmtrace.render.html.templating import env

WIDTH, HEIGHT, PAD = 760, 200, 40
SHOWN = 200  # rollouts whose tokens are drawn (the most disagreeing first)


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec)


def delta(t: dict[str, Any]) -> float | None:
    """trainer − engine of a token (None where the trainer's processing removes it)."""
    return None if t["trainer_logprob"] is None else t["trainer_logprob"] - t["engine_logprob"]


def colour(d: float | None) -> str:
    """Transparent at 0, full red at |Δ| ≥ 1 nat on a log scale from 1e-4; purple: impossible."""
    if d is None:
        return "rgba(126,34,206,0.8)"
    a = 0.0 if abs(d) < 1e-4 else min(1.0, (math.log10(abs(d)) + 4) / 4)
    return f"rgba(220,38,38,{a:.3f})"


def title(t: dict[str, Any]) -> str:
    return (
        f"#{t['index']} id {t['token_id']}: engine {_fmt(t['engine_logprob'])}, raw {_fmt(t['raw_logprob'])}, "
        f"processed {_fmt(t['processed_logprob'])}, trainer {_fmt(t['trainer_logprob'])}; processing "
        f"{_fmt(t['processing'])}, residual {_fmt(t['residual'])}, ratio {_fmt(t['ratio'])}"
    )


def histogram_svg(values: list[float], bins: int = 41) -> Markup:
    """The log-ratios (trainer − engine) as bars, symmetric around 0; the [0.9, 1.1] band shaded."""
    if not values:
        return Markup("<p class='note'>no tokens</p>")
    edge = max(max(abs(v) for v in values), math.log(1.1) * 1.5, 1e-6)
    width = 2 * edge / bins
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v + edge) / width))] += 1
    top = max(counts)
    x = lambda v: PAD + (WIDTH - PAD - 10) * (v + edge) / (2 * edge)  # noqa: E731
    h = HEIGHT - 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">',
        f'<rect x="{x(math.log(0.9)):.1f}" y="8" width="{x(math.log(1.1)) - x(math.log(0.9)):.1f}" '
        f'height="{h}" fill="#dcfce7"/>',
    ]
    for i, c in enumerate(counts):
        if c:
            bh = h * c / top
            bw = max(1.0, x(width) - x(0) - 1)
            parts.append(
                f'<rect x="{x(-edge + i * width):.1f}" y="{8 + h - bh:.1f}" width="{bw:.1f}" '
                f'height="{bh:.1f}" fill="#2563eb"><title>{c} tokens</title></rect>'
            )
    for v in (-edge, 0.0, edge):
        parts.append(f'<text x="{x(v):.1f}" y="{HEIGHT - 6}" font-size="11" text-anchor="middle">{v:+.3g}</text>')
    parts.append(f'<text x="4" y="16" font-size="11">{top}</text></svg>')
    return Markup("".join(parts))


def _rollout_view(r: dict[str, Any]) -> dict[str, Any]:
    tokens = [{**t, "colour": colour(delta(t)), "title": title(t), "delta": delta(t)} for t in r["tokens"]]
    worst = max((abs(t["delta"]) if t["delta"] is not None else math.inf for t in tokens), default=0.0)
    causes = [{**c, "evidence": json.dumps(c["evidence"], ensure_ascii=False, default=str)[:600]} for c in r["causes"]]
    return {
        "id": r["id"],
        "prompt": r.get("prompt_text", ""),
        "tokens": tokens,
        "causes": causes,
        "worst": worst,
        "flagged": sum(t["flagged"] for t in tokens),
    }


def render_rollouts_html(report: dict[str, Any]) -> str:
    views = sorted((_rollout_view(r) for r in report["rollouts"]), key=lambda v: -v["worst"])
    values = [d for r in report["rollouts"] for t in r["tokens"] if (d := delta(t)) is not None]
    return (
        env()
        .get_template("rollouts.html.j2")
        .render(
            model=report["model"]["source"],
            fmt=report["format"],
            trainer=report["trainer"],
            s=report["summary"],
            rollouts=views[:SHOWN],
            hidden=max(0, len(views) - SHOWN),
            histogram=histogram_svg(values),
            locate=report.get("locate"),
            skipped=report.get("skipped_variants", []),
            f=_fmt,
        )
    )


def write_rollouts_html(path: str | Path, report: dict[str, Any]) -> None:
    write_atomic(path, render_rollouts_html(report))
