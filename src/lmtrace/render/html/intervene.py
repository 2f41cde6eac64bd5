"""The `lmtrace intervene` HTML report, in the report's own page as kv-lab's is: the reference
text, a summary table per intervention, KL and logprob change per step, the reference's tokens
under each arm (coloured by the change, each with the panel's numbers) and each arm's own
free-running text. Model text goes through Jinja's autoescaping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from markupsafe import Markup, escape

from lmtrace.files import write_atomic
from lmtrace.render import views
from lmtrace.render.html.kvlab import ArmsPage, arms_page, delta_colour
from lmtrace.render.html.sections import Section, text_section
from lmtrace.render.html.svg import Series, line_chart
from lmtrace.render.html.templating import parts
from lmtrace.render.tokens import escape as visible


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _arm_steps(arm: dict[str, Any], ref_steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for step, ref in zip(arm["steps"], ref_steps):
        record = {
            "index": step["index"],
            "token_id": ref["token_id"],
            "text": ref["text"],
            "bytes": ref["bytes"],
            "logprob": step["logprob"],
            "top": [],
            "Δ logprob vs reference": step["delta"],
            "KL(reference ‖ arm)": step["kl"],
            "top-1 agrees": step["top1_agree"],
        }
        view = views.token_view(record, step["index"])
        view["style"] = f"background: {delta_colour(step['delta'])}"
        out.append(view)
    return out


def _summary(arms: list[dict[str, Any]]) -> Markup:
    columns = ["intervention", "mean KL", "max KL", "top-1 agree", "mean Δlogprob", "diverges at"]
    rows = [
        {
            "intervention": "reference",
            "mean KL": "0",
            "max KL": "0",
            "top-1 agree": "—",
            "mean Δlogprob": "0",
            "diverges at": "—",
        }
    ]
    for a in arms:
        s, div = a["summary"], a["summary"].get("divergence_step")
        agree = s.get("top1_agreement")
        rows.append(
            {
                "intervention": a["intervention"],
                "mean KL": _fmt(s["mean_kl"], ".4f"),
                "max KL": _fmt(s["max_kl"], ".4f"),
                "top-1 agree": "—" if agree is None else f"{100 * agree:.1f}%",
                "mean Δlogprob": _fmt(s.get("mean_delta"), "+.4f"),
                "diverges at": "never" if div is None else f"step {div}",
            }
        )
    note = Markup(
        "<p class='meta'>Teacher-forced on the reference's tokens: KL(reference ‖ arm) in nats, top-1 "
        "agree: the arm's most likely token is the reference's. Diverges at: the first step where the arm, "
        "generating alone with the reference's settings and seed, chose another token.</p>"
    )
    return parts().table(rows, columns) + note


def _sections(d: dict[str, Any], tvs: list[list[dict[str, Any]]]) -> list[Section]:
    arms, ref, p = d["arms"], d["reference"], parts()
    css = [f"c{k % 6}" for k in range(len(arms))]

    def series(key: str) -> list[Series]:
        return [
            Series(a["intervention"], [s[key] for s in a["steps"]], c, k + 1) for k, (a, c) in enumerate(zip(arms, css))
        ]

    named = [visible(s["text"]) for s in ref["steps"]]
    charts = p.charts(
        [
            ("KL(reference ‖ arm) per step, nats", line_chart(series("kl"), "KL per step", labels=named)),
            (
                "logprob change of the reference token per step",
                line_chart(series("delta"), "logprob change", labels=named),
            ),
        ]
    )
    under = Markup()
    for k, (a, tv) in enumerate(zip(arms, tvs[1:])):
        under += Markup(f"<h3><span class='swatch {css[k]}'></span>") + escape(a["intervention"]) + Markup("</h3>")
        under += p.tokens(tv, k + 1)
        free = a.get("free") or {}
        if free.get("first_divergence") is not None:
            under += (
                Markup("<p class='meta'>")
                + escape(f"alone, differs from step {free['first_divergence']}: {free['text']}")
                + Markup("</p>")
            )
    return [
        text_section(tvs[0], ref["prompt"]["text"], False),
        Section("summary", "Summary", _summary(arms)),
        Section("charts", "Per step", charts),
        Section(
            "arms",
            "The reference's tokens under each intervention",
            Markup(
                "<p class='meta'>Each token of the reference, coloured by how much its logprob changed under the "
                "intervention: red lower, green higher (full colour at 2 nats). Hover over a token for its numbers.</p>"
            )
            + under,
        ),
    ]


def render_intervene_html(result: Any) -> str:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    ref = d["reference"]
    tvs = [views.token_views(ref["steps"])] + [_arm_steps(a, ref["steps"]) for a in d["arms"]]
    script = [{"label": "reference", "steps": views.for_script(tvs[0])}]
    script += [{"label": a["intervention"], "steps": views.for_script(tv)} for a, tv in zip(d["arms"], tvs[1:])]
    model = ref.get("model") or {}
    about = [("reference", f"{len(ref['steps'])} tokens"), ("arms", ", ".join(a["intervention"] for a in d["arms"]))]
    source = model.get("source", "")
    page = ArmsPage(
        f"lmtrace · intervene · {source}",
        f"Interventions: {source}",
        f"{len(d['arms'])} interventions against the reference",
        ("Interventions", about),
    )
    return arms_page(ref, page, _sections(d, tvs), script)


def write_intervene_html(path: str | Path, result: Any) -> None:
    write_atomic(path, render_intervene_html(result))
