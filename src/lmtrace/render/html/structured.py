"""The report's sections of a constrained trace: the JSON output with each value shaded by how
sure the model was of it and the values listed weakest first; each choice's exact probability;
the steps where the grammar, not the model, chose. Each returns None when its data is absent."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from lmtrace.render.html.svg import Series, line_chart
from lmtrace.render.html.templating import parts
from lmtrace.render.terminal.structured import flagged, probability, shown, weakest_first
from lmtrace.render.views import bucket


def _runs(text: str, fields: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any] | None]]:
    """The text cut into (piece, field or None) runs: each field's characters shaded by its
    probability under the constraint, the JSON syntax between them plain."""
    runs: list[tuple[str, dict[str, Any] | None]] = []
    pos = 0
    for f in sorted((f for f in fields if isinstance(f.get("chars"), list)), key=lambda f: f["chars"][0]):
        start, end = f["chars"]
        if start < pos:  # overlapping spans cannot be shaded twice
            continue
        if start > pos:
            runs.append((text[pos:start], None))
        p = probability(f.get("logprob"))
        least = shown(f.get("min_prob"))
        title = f"{f['path']}: p {shown(p)} under the constraint, least likely token {least}"
        runs.append((text[start:end], {"b": bucket(p), "title": title}))
        pos = end
    if pos < len(text):
        runs.append((text[pos:], None))
    return runs


def fields_section(d: dict[str, Any]) -> Any:
    """The JSON output shaded by each value's confidence, then the values weakest first."""
    fields = d.get("fields")
    if not fields:
        return None
    p = parts()
    rows = []
    for f in weakest_first(fields):
        rows.append(
            {
                "path": f["path"],
                "value": f["text"],
                "p": shown(probability(f.get("logprob"))),
                "raw p": shown(probability(f.get("raw_logprob"))),
                "least likely token": shown(f.get("min_prob")),
                "steps": f"{f['start_step']}–{f['end_step']}",
            }
        )
    note = Markup(
        "<p class=\"meta\">Each value's probability under the constraint: the product of its tokens' probabilities "
        "under the raw distribution restricted to what the grammar allowed (a token that spans a boundary counts "
        "for every value it carries characters of). Shaded as the tokens are; hover for the numbers.</p>"
    )
    body = note + p.shaded_json(_runs(d.get("text") or "", fields))
    columns = ["path", "value", "p", "raw p", "least likely token", "steps"]
    body += Markup("<h3>Least sure first</h3>") + p.table(rows, columns)
    return ("fields", "Structured output: how sure was the model of each field?", body)


def choices_section(d: dict[str, Any]) -> Any:
    """Each option's exact probability after the prompt, summed over its tokenizations."""
    choices = d.get("choices")
    if not choices:
        return None
    chosen = d.get("text")
    rows = [
        {
            "option": c["text"] + ("  ◀ generated" if c["text"] == chosen else ""),
            "p": shown(probability(c.get("logprob"))),
            "tokenizations": c.get("tokenizations"),
        }
        for c in sorted(choices, key=lambda c: -(probability(c.get("logprob")) or 0.0))
    ]
    note = Markup(
        '<p class="meta">Each option\'s probability under the constraint, summed over every tokenization the '
        "grammar allows (teacher-forced; the options sum to 1).</p>"
    )
    return ("choices", "Choices", note + parts().table(rows, ["option", "p", "tokenizations"]))


def grammar_section(d: dict[str, Any]) -> Any:
    """The raw probability the grammar removed at each step, and the steps where it removed more
    than half (there the grammar chose, not the model)."""
    steps = [s for s in d.get("steps") or [] if isinstance(s.get("grammar"), dict)]
    if not steps:
        return None
    found = flagged((s["index"], s["grammar"]) for s in steps)
    chart = line_chart(
        [Series("removed", [s["grammar"]["removed_mass"] for s in steps], "c4")],
        "raw probability the grammar removed per step",
        1.0,
        x_label="step",
    )
    if found:
        listed = ", ".join(f"{i} ({m:.0%})" for i, m in found)
        text = (
            f"The grammar removed more than half of the raw probability at {len(found)} of {len(steps)} steps "
            f"(marked with a red top edge in the text): there the grammar chose, not the model. Steps: {listed}."
        )
    else:
        text = f"The grammar removed at most half of the raw probability at each of the {len(steps)} steps."
    body = Markup('<p class="meta">{}</p>').format(text) + parts().charts([("removed by the grammar", chart)])
    return ("grammar", "Grammar", body)
