"""The kv-lab HTML report, in the report's own page (report.html.j2: its style, header, hover
panel and charts with axes): the reference text, a summary table, KL and logprob change per step
for every policy, the reference's tokens under each policy (coloured by the change, each with the
panel's numbers), and what each policy kept per layer and position. Model text goes through
Jinja's autoescaping; the SVG carries numbers and escaped token text only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape

from lmtrace.files import write_atomic
from lmtrace.render import views
from lmtrace.render.html import facts
from lmtrace.render.html.sections import Section, text_section
from lmtrace.render.html.svg import Series, line_chart
from lmtrace.render.html.templating import env, parts, script_hash, script_json, static
from lmtrace.render.terminal.kvlab import human_bytes, reference_perplexity
from lmtrace.render.tokens import escape as visible

WIDTH, ROW = 560, 6  # the kept map's viewBox width and row height


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


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """[(start, length)] of consecutive positions."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def map_svg(kept: list[list[int]] | None, width: int, css: str, tokens: list[str]) -> Markup:
    """Layers (1 at the top) x positions: a filled cell where the layer kept the position; a
    layer axis, a position axis and, for up to 48 positions, each position's token."""
    if not kept:
        return Markup("<p class='meta'>no map</p>")
    left, top, named = 34, 14, width <= 48
    cell = (WIDTH - left - 6) / max(1, width)
    bottom = 22 + (46 if named else 0)
    height = top + ROW * len(kept) + bottom
    parts_ = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" style="max-width: 720px" role="img" '
        'aria-label="positions kept per layer">',
        f'<text class="tick axis" x="2" y="{top - 4}">layer</text>',
        f'<rect x="{left}" y="{top}" width="{cell * width:.1f}" height="{ROW * len(kept)}" fill="#eef1f4"/>',
    ]
    every = max(1, math.ceil(len(kept) / 6))
    for layer in sorted({0, *range(every - 1, len(kept), every)}):
        y = top + ROW * layer + ROW - 1
        parts_.append(f'<text class="tick" x="{left - 4}" y="{y}" text-anchor="end">{layer + 1}</text>')
    for layer, positions in enumerate(kept):
        for start, length in _runs(sorted(int(p) for p in positions)):
            parts_.append(
                f'<rect class="bar {css}" x="{left + start * cell:.2f}" y="{top + layer * ROW}" '
                f'width="{length * cell:.2f}" height="{ROW - 1}"/>'
            )
    base = top + ROW * len(kept) + 12
    step = max(1, math.ceil(width / 12))
    for p in range(width):
        x = left + (p + 0.5) * cell
        if named or p % step == 0:
            parts_.append(f'<text class="tick" x="{x:.1f}" y="{base}" text-anchor="middle">{p}</text>')
        if named and p < len(tokens) and tokens[p]:
            shown = tokens[p] if len(tokens[p]) <= 10 else tokens[p][:9] + "…"
            parts_.append(
                f'<text class="tick token" transform="translate({x + 3:.1f},{base + 6}) rotate(-60)" '
                f'text-anchor="end">{escape(shown)}</text>'
            )
    parts_.append(f'<text class="tick axis" x="{left - 4}" y="{base}" text-anchor="end">pos</text></svg>')
    return Markup("".join(parts_))


def _arm_steps(arm: dict[str, Any], ref_steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference's tokens with this policy's numbers, as token views (the panel shows the
    extra fields: the change, KL, agreement, positions kept, cache bytes)."""
    out = []
    for step, ref in zip(arm["steps"], ref_steps):
        record = {
            "index": step["index"],
            "token_id": ref["token_id"],
            "text": ref["text"],
            "bytes": ref["bytes"],
            "logprob": step["logprob"],
            "rank": step["rank"],
            "top": [],
            "Δ logprob vs full": step["delta"],
            "KL(full ‖ policy)": step["kl"],
            "top-1 agrees": step["top1_agree"],
            "positions kept (layer 1)": (step["kept"] or [0])[0],
            "cache bytes": step["bytes"],
        }
        view = views.token_view(record, step["index"])
        view["style"] = f"background: {delta_colour(step['delta'])}"
        out.append(view)
    return out


def _summary(d: dict[str, Any], arms: list[dict[str, Any]]) -> Markup:
    columns = [
        "policy",
        "cache kept",
        "bytes (last step)",
        "mean KL",
        "max KL",
        "top-1 agree",
        "perplexity",
        "diverges at",
        "evicted attention",
    ]
    rows = [
        {
            "policy": "reference (full cache)",
            "cache kept": "100%",
            "mean KL": "0",
            "max KL": "0",
            "top-1 agree": "100%",
            "diverges at": "—",
            "evicted attention": "—",
            "bytes (last step)": human_bytes(d["reference_bytes"][-1] if d["reference_bytes"] else None),
            "perplexity": _fmt(reference_perplexity(d), ".3f"),
        }
    ]
    for a in arms:
        s, div = a["summary"], a["summary"].get("divergence_step")
        rows.append(
            {
                "policy": a["policy"],
                "cache kept": _pct(s["bytes_fraction"]),
                "bytes (last step)": human_bytes(s.get("bytes_final")),
                "mean KL": _fmt(s["mean_kl"], ".4f"),
                "max KL": _fmt(s["max_kl"], ".4f"),
                "top-1 agree": _pct(s["top1_agreement"]),
                "perplexity": _fmt(s["perplexity"], ".3f"),
                "diverges at": "never" if div is None else f"step {div}",
                "evicted attention": _fmt(s.get("mean_evicted_mass"), ".3f"),
            }
        )
    note = Markup(
        "<p class='meta'>cache kept: the arm's bytes measured on its tensors over the full cache's, mean "
        "over steps. KL(full ‖ arm) in nats. Evicted attention: the attention the full cache's query put "
        "on positions the arm had evicted (mean over layers and heads).</p>"
    )
    return parts().table(rows, columns) + note


def _policy_tokens(p: Any, arms: list[dict[str, Any]], tvs: list[list[dict[str, Any]]], css: list[str]) -> Markup:
    """Each policy's heading, the reference's tokens under it, and what it generated alone."""
    under = Markup()
    for k, (a, tv) in enumerate(zip(arms, tvs)):
        under += Markup(f"<h3><span class='swatch {css[k]}'></span>") + escape(a["policy"]) + Markup("</h3>")
        under += p.tokens(tv, k + 1)
        free = a.get("free") or {}
        if free.get("text"):
            alone = escape(f"alone from step {free.get('divergence_step')}: {free['text']}")
            under += Markup("<p class='meta'>") + alone + Markup("</p>")
    return under


def _sections(d: dict[str, Any], tvs: list[list[dict[str, Any]]]) -> list[Section]:
    arms, ref = d["arms"], d["reference"]
    p = parts()
    css = [f"c{k % 6}" for k in range(len(arms))]

    def series(key: str) -> list[Series]:  # a line per policy; its points select its row of tokens
        return [Series(a["policy"], [s[key] for s in a["steps"]], c, k + 1) for k, (a, c) in enumerate(zip(arms, css))]

    named = [visible(s["text"]) for s in ref["steps"]]  # each point's tip names its step's token
    charts = p.charts(
        [
            ("KL(full ‖ policy) per step, nats", line_chart(series("kl"), "KL per step", labels=named)),
            (
                "logprob change of the reference token per step",
                line_chart(series("delta"), "logprob change", labels=named),
            ),
        ]
    )
    under = _policy_tokens(p, arms, tvs[1:], css)
    width = d["prompt_tokens"] + (d.get("map_step") or 0)
    known = ref["prompt"].get("tokens") or [""] * d["prompt_tokens"]  # the prompt's texts where recorded
    tokens = [visible(t) for t in known] + named
    maps = Markup().join(
        Markup("<h3>") + escape(a["policy"]) + Markup("</h3>") + map_svg(a.get("kept_map"), width, c, tokens)
        for a, c in zip(arms, css)
    )
    step = d.get("map_step") or 0
    return [
        text_section(tvs[0], ref["prompt"]["text"], False),
        Section("summary", "Summary", _summary(d, arms)),
        Section("charts", "Per step", charts),
        Section(
            "policies",
            "The reference's tokens under each policy",
            Markup(
                "<p class='meta'>Each token of the reference, coloured by how much its logprob changed under the "
                "policy: red lower, green higher (full colour at 2 nats). Hover over a token for its numbers.</p>"
            )
            + under,
        ),
        Section(
            "kept",
            f"What each policy kept at step {step}",
            Markup(
                f"<p class='meta'>Rows: decoder layers 1 … {len(arms[0].get('kept_map') or []) if arms else 0}; "
                f"columns: positions 0 … {width - 1}; filled: kept in the cache after the pass that produced step "
                f"{step}.</p>"
            )
            + maps,
        ),
    ]


@dataclass(frozen=True)
class ArmsPage:
    """What a page of arms against a reference (kv-lab's policies, intervene's interventions) says:
    its title, heading and subheading, and its own group of facts beside the model's."""

    title: str
    heading: str
    subheading: str
    facts: tuple[str, list]


def arms_page(ref: dict[str, Any], page: ArmsPage, sections: list[Section], script: list[dict[str, Any]]) -> str:
    """Arms against a reference in the report's own page (its style, header, hover and panels)."""
    js, model = static("report.js"), ref.get("model") or {}
    return (
        env()
        .get_template("report.html.j2")
        .render(
            kind="kvlab",
            title=page.title,
            heading=page.heading,
            subheading=page.subheading,
            header=parts().facts([facts.model_group(model), page.facts]),
            sections=sections,
            footer="This file is self-contained: it loads nothing from anywhere.",
            data=script_json({"kind": "kvlab", "sampled": False, "views": script}),
            css=Markup(static("report.css")),
            js=Markup(js),
            script_hash=script_hash(js),
            version=(ref.get("versions") or {}).get("lmtrace", ""),
        )
    )


def render_lab_html(result: Any) -> str:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    ref = d["reference"]
    tvs = [views.token_views(ref["steps"])] + [_arm_steps(a, ref["steps"]) for a in d["arms"]]
    script = [{"label": "reference (full cache)", "steps": views.for_script(tvs[0])}]
    script += [{"label": a["policy"], "steps": views.for_script(tv)} for a, tv in zip(d["arms"], tvs[1:])]
    model = ref.get("model") or {}
    lab = [
        ("prompt", f"{d['prompt_tokens']} tokens"),
        (
            "reference",
            f"{len(ref['steps'])} tokens, "
            + ("teacher-forced text" if d.get("teacher_forced") else "generated with the full cache"),
        ),
        ("policies", ", ".join(a["policy"] for a in d["arms"])),
    ]
    source = model.get("source", "")
    page = ArmsPage(
        f"lmtrace · kv-lab · {source}",
        f"KV-cache lab: {source}",
        f"{len(d['arms'])} policies against the full cache",
        ("Lab", lab),
    )
    return arms_page(ref, page, _sections(d, tvs), script)


def write_lab_html(path: str | Path, result: Any) -> None:
    write_atomic(path, render_lab_html(result))
