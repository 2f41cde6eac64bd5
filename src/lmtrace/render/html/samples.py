"""The page `lmtrace sample --html` writes, one self-contained file and no script: the votes
and answer-level scores, the early stop, then the samples side by side, each with its answer,
its stop, its tokens shaded by confidence and its confidence chart. Model text goes through
Jinja's autoescape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmtrace.files import write_atomic
from lmtrace.render.html.templating import env
from lmtrace.render.html.uncertainty import confidence_svg, shade


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "—" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def _card(
    entry: dict[str, Any], trace: dict[str, Any] | None, low: float, high: float, window: int, threshold: float | None
) -> dict[str, Any]:
    steps = (trace or {}).get("steps", [])
    conf = [s["uncertainty"]["confidence"] for s in steps]
    tokens = [
        {
            "text": s["text"],
            "colour": shade(c, low, high),
            "title": f"step {s['index']}: confidence {c:.3f}, logprob {_fmt(s['logprob'])}",
        }
        for s, c in zip(steps, conf)
    ]
    status = "kept" if entry["kept"] else f"stopped ({entry['stopped']})" if entry["stopped"] else "filtered"
    return {**entry, "tokens": tokens, "status": status, "svg": confidence_svg(conf, window, threshold, 340, 90)}


def render_samples_html(result: Any) -> str:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    traces = {t_i: t for t_i, t in zip([e["index"] for e in d["samples"] if e["decoded"]], d["traces"])}
    every = [s["uncertainty"]["confidence"] for t in d["traces"] for s in t["steps"]]
    low, high = (min(every), max(every)) if every else (0.0, 1.0)
    stop = d.get("early_stop")
    threshold = stop["threshold"] if stop else None
    window = d["settings"]["confidence_window"]
    cards = [_card(e, traces.get(e["index"]), low, high, window, threshold) for e in d["samples"]]
    model = (d["traces"][0].get("model") or {}).get("source", "") if d["traces"] else ""
    return env().get_template("samples.html.j2").render(d=d, cards=cards, model=model, stop=stop, fmt=_fmt)


def write_samples_html(path: str | Path, result: Any) -> None:
    write_atomic(path, render_samples_html(result))
