"""The kv-lab HTML report: one self-contained file, no script; every text from the model goes
through Jinja's autoescaping, the SVG charts carry numbers only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from markupsafe import Markup

from lmtrace.files import write_atomic
from lmtrace.render.kvlab_terminal import human_bytes, reference_perplexity
from lmtrace.render.templating import env

PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"]
WIDTH, HEIGHT = 760, 220


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def delta_colour(delta: float | None) -> str:
    """Red where the policy lowered the reference token's logprob, green where it raised it."""
    if delta is None:
        return "transparent"
    a = min(1.0, abs(delta) / 2.0)
    return f"rgba(220,38,38,{a:.3f})" if delta < 0 else f"rgba(22,163,74,{a:.3f})"


def kl_svg(arms: list[dict[str, Any]], colours: list[str]) -> Markup:
    n = max((len(a["steps"]) for a in arms), default=0)
    top = max((s["kl"] for a in arms for s in a["steps"]), default=0.0) or 1.0
    pad = 34
    xs = lambda i: pad + (WIDTH - pad - 8) * (i / max(1, n - 1))  # noqa: E731
    ys = lambda v: HEIGHT - 20 - (HEIGHT - 30) * (v / top)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">',
             f'<line x1="{pad}" y1="{HEIGHT - 20}" x2="{WIDTH}" y2="{HEIGHT - 20}" stroke="#999"/>',
             f'<text x="2" y="14" font-size="11">{top:.3g}</text>',
             f'<text x="2" y="{HEIGHT - 22}" font-size="11">0</text>',
             f'<text x="{WIDTH - 60}" y="{HEIGHT - 4}" font-size="11">step {n - 1}</text>']  # fmt: skip
    for arm, colour in zip(arms, colours):
        points = " ".join(f"{xs(i):.1f},{ys(s['kl']):.1f}" for i, s in enumerate(arm["steps"]))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """[(start, length)] of consecutive positions."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def map_svg(kept: list[list[int]] | None, width: int, colour: str) -> Markup:
    """Layers x positions: a dark cell where the layer kept the position."""
    if not kept:
        return Markup("<p class='note'>no map</p>")
    cell = (WIDTH - 10) / max(1, width)
    row = 5
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{row * len(kept) + 2}" role="img">',
             f'<rect x="0" y="0" width="{cell * width:.1f}" height="{row * len(kept)}" fill="#eee"/>']  # fmt: skip
    for layer, positions in enumerate(kept):
        for start, length in _runs(sorted(int(p) for p in positions)):
            parts.append(f'<rect x="{start * cell:.2f}" y="{layer * row}" width="{length * cell:.2f}" '
                         f'height="{row - 1}" fill="{colour}"/>')  # fmt: skip
    parts.append("</svg>")
    return Markup("".join(parts))


def _arm_view(arm: dict[str, Any], ref_steps: list[dict[str, Any]], colour: str, width: int) -> dict[str, Any]:
    s = arm["summary"]
    tokens = []
    for step, ref in zip(arm["steps"], ref_steps):
        title = (f"step {step['index']}: logprob {_fmt(step['logprob'], '.3f')} (full {_fmt(ref['logprob'], '.3f')}, "
                 f"delta {_fmt(step['delta'], '+.3f')}), KL {_fmt(step['kl'], '.4f')}, rank {step['rank']}, "
                 f"kept {step['kept'][0] if step['kept'] else 0}/layer, {step['bytes']} B")  # fmt: skip
        tokens.append({"text": ref["text"], "colour": delta_colour(step["delta"]), "title": title})
    free = arm.get("free") or {}
    div = s.get("divergence_step")
    return {
        "policy": arm["policy"], "colour": colour, "kept": _pct(s["bytes_fraction"]),
        "bytes": human_bytes(s.get("bytes_final")), "mean_kl": _fmt(s["mean_kl"], ".4f"),
        "max_kl": _fmt(s["max_kl"], ".4f"), "top1": _pct(s["top1_agreement"]), "ppl": _fmt(s["perplexity"], ".3f"),
        "divergence": "never" if div is None else f"step {div}", "evicted": _fmt(s.get("mean_evicted_mass"), ".3f"),
        "tokens": tokens, "free": free.get("text"), "free_step": free.get("divergence_step"),
        "map_svg": map_svg(arm.get("kept_map"), width, colour),
    }  # fmt: skip


def render_lab_html(result: Any) -> str:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    ref = d["reference"]
    arms = d["arms"]
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(arms))]
    map_step = d.get("map_step") or 0
    width = d["prompt_tokens"] + map_step  # the pass that produced step s held prompt + s positions
    model = ref.get("model") or {}
    return env().get_template("kvlab.html.j2").render(
        model=model.get("source", ""),
        prompt=ref["prompt"]["text"],
        prompt_tokens=d["prompt_tokens"],
        steps=len(ref["steps"]),
        teacher_forced=d.get("teacher_forced"),
        reference_text="".join(s["text"] for s in ref["steps"]),
        ref_bytes=human_bytes(d["reference_bytes"][-1] if d["reference_bytes"] else None),
        ref_ppl=_fmt(reference_perplexity(d), ".3f"),
        arms=[_arm_view(a, ref["steps"], c, width) for a, c in zip(arms, colours)],
        kl_svg=kl_svg(arms, colours),
        map_step=map_step,
        map_width=width,
    )


def write_lab_html(path: str | Path, result: Any) -> None:
    write_atomic(path, render_lab_html(result))
