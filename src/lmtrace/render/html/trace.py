"""The HTML report: one self-contained file (inline CSS, JS and SVG; nothing loaded from
anywhere), and the notebook view of a trace. Reads records only: no torch here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from markupsafe import Markup

from lmtrace.errors import InvalidParameter
from lmtrace.files import write_atomic
from lmtrace.render import views
from lmtrace.render.html import facts, inside, sections
from lmtrace.render.html.templating import env, parts, script_hash, script_json, script_lines, static
from lmtrace.render.kinds import BRANCHES, SCORE, TRACE, as_record

_PAGES = {TRACE: sections.trace_page, SCORE: sections.score_page, BRANCHES: sections.branches_page}
_HEADINGS = {TRACE: "Trace", SCORE: "Score", BRANCHES: "Branches"}


def render_html(obj: Any, title: str | None = None) -> str:
    """The report as one HTML document (a str), for any of:

    - a `Trace`, or a trace dict (`Trace.to_dict()` / the `--json` file: `schema_version`, `steps`);
    - a score result: a dict (or an object with `to_dict()`) holding `tokens` (per-token records
      with `token_id`, `text`, `logprob` (null for an unscored token), `rank`, `entropy`, `top`)
      and `perplexity`; other top-level numbers (`total_logprob`, `bits_per_byte`, ...) show in
      the header, and `model` (the trace's model dict or a string) when present;
    - branches: `{"branches": [trace, ...]}` (dicts or Traces, the original first) or a list of
      Traces; a trace's optional `label` names its column.

    Optional data shows where present: `step["kv"]["layers"]` (a list of dicts per layer: a
    table and a bytes-per-layer chart), a trace-level KV anatomy dict (`kv_anatomy` or `kv`),
    `step["waterfall"]` (a list of dicts per sampling stage, in the token panel), and any other
    plain value on a step (in the panel). Raises InvalidParameter when `obj` is none of these.

    For a command: `@report_options` (adds `--html FILE` and `--plot FILE.png`), then
    `check_report_paths(html, plot)` before the work and `write_reports(result, html, plot,
    console)` after it, all from `lmtrace.cli.reports`; or call `write_html(path, result)`
    directly. A new kind of data is one small function in `sections.py` (it returns None when
    its data is absent) added to the page of its kind.
    """
    try:
        kind, d = as_record(obj)
    except ValueError as e:
        raise InvalidParameter(f"html: {e}") from e
    found, script_views, sampled = _PAGES[kind](d)
    counted = [{k: v for k, v in view.items() if k != "steps"} | {"count": len(view["steps"])} for view in script_views]
    first = d["branches"][0] if kind == BRANCHES else d
    model = first.get("model")
    source = model.get("source") if isinstance(model, dict) else model
    groups = facts.score_groups(d) if kind == SCORE else facts.trace_groups(first)
    js = static("report.js")
    return (
        env()
        .get_template("report.html.j2")
        .render(
            kind=kind,
            title=title or f"lmtrace · {_HEADINGS[kind].lower()} · {source or 'report'}",
            heading=f"{_HEADINGS[kind]}: {source}" if source else _HEADINGS[kind],
            subheading=_subheading(kind, d),
            header=parts().facts(groups),
            sections=found,
            footer=_footer(first.get("versions")),
            data=script_json({"kind": kind, "sampled": sampled, "views": counted}),
            step_lines=[script_lines(view["steps"]) for view in script_views],
            css=Markup(static("report.css")),
            js=Markup(js),
            script_hash=script_hash(js),
            version=(first.get("versions") or {}).get("lmtrace", ""),
        )
    )


def page_data(page: str) -> dict[str, Any]:
    """The data a report embeds, each view's steps read back from their lines (for tests and tools)."""
    found = re.search(r'<script type="application/json" id="lmtrace-data">(.*?)</script>', page, re.S)
    if found is None:
        raise ValueError("not an lmtrace report: no lmtrace-data")
    data = json.loads(found.group(1))
    for k, view in enumerate(data["views"]):
        if "steps" not in view:
            lines = re.search(rf'<script type="application/x-ndjson" id="lmtrace-steps-{k}">(.*?)</script>', page, re.S)
            view["steps"] = [json.loads(line) for line in lines.group(1).split("\n") if line] if lines else []
    return data


def write_html(path: str | Path, obj: Any, title: str | None = None) -> None:
    """Writes `render_html(obj, title)` to `path` atomically (a reader never sees half a file)."""
    write_atomic(path, render_html(obj, title))


def _subheading(kind: str, d: dict[str, Any]) -> str:
    if kind == TRACE:
        note = sections.origin_note(d)
        return f"{len(d['steps'])} steps, finish: {d.get('finish_reason', '–')}" + (f" · {note}" if note else "")
    if kind == SCORE:
        return f"{len(d['tokens'])} tokens, perplexity {facts.value(d.get('perplexity'))}"
    return f"{len(d['branches'])} branches"


def _footer(versions: Any) -> str:
    found = ", ".join(f"{k} {v}" for k, v in (versions or {}).items())
    made = f"Made with {found}. " if found else ""
    return made + "This file is self-contained: it loads nothing from anywhere."


def notebook_html(obj: Any) -> str:
    """A compact view for Jupyter (`Trace._repr_html_`): the coloured tokens, each with a hover
    panel of alternatives. CSS only, no script and no ids, so it works where notebook outputs
    are sanitised and when many traces share a page."""
    try:
        kind, d = as_record(obj)
    except ValueError as e:
        raise InvalidParameter(f"html: {e}") from e
    if kind != TRACE:
        raise InvalidParameter(f"html: the notebook view is for a trace, got {kind}")
    tv = views.token_views(d["steps"])
    model = d.get("model") or {}
    return (
        env()
        .get_template("notebook.html.j2")
        .render(
            source=model.get("source", ""),
            subheading=_subheading(kind, d),
            prompt=(d.get("prompt") or {}).get("text", ""),
            views=tv,
            legend=sections.LEGEND,
            sampled=views.sampling_differs(tv),
            heatmap=inside.lens_heatmap(d["steps"]),
            settled=[v["lens"]["settled"] for v in tv if "lens" in v],
            css=Markup(static("notebook.css")),
        )
    )
