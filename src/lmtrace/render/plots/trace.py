"""A matplotlib figure of a record, as PNG: probability and entropy of the chosen token per
step and KV-cache bytes per step (a trace); per token (a score result); probability and
cumulative negative logprob per branch (branches). Uses Figure and the Agg canvas directly:
no pyplot, so no global state and no display needed."""

from __future__ import annotations

import io
import math
from itertools import accumulate
from pathlib import Path
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.files import write_atomic_bytes
from lmtrace.render import views
from lmtrace.render.kinds import BRANCHES, SCORE, as_record

RAW, SAMPLED = "#2563eb", "#ea580c"
# the report's series colours (report.css --c0 .. --c5): a series has one colour in a PNG and on its page
PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2"]


def figure_png(fig: Any, title: str, dpi: int) -> bytes:
    """`fig` titled and saved as PNG bytes (parse_math=False: a model name or text with "$" must
    not be read as TeX)."""
    fig.suptitle(title, fontsize=10, parse_math=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _xs(values: list[Any]) -> tuple[list[int], list[float]]:
    """The steps that have a value (an unscored first token has none)."""
    pairs = [(i, v) for i, v in enumerate(values) if v is not None]
    return [i for i, _ in pairs], [v for _, v in pairs]


def _line(ax: Any, values: list[Any], label: str, colour: str | None = None) -> None:
    x, y = _xs(values)
    ax.plot(x, y, marker="o" if len(x) <= 80 else None, markersize=3, linewidth=1.3, label=label, color=colour)


def _trace_axes(fig: Any, tv: list[dict[str, Any]], what: str) -> None:
    raw = views.raw_known(tv)  # False for a trace of processed scores only: those are drawn instead
    sampled = views.sampling_differs(tv) or not raw
    kv = [(v.get("kv") or {}).get("bytes") for v in tv]
    rows = 3 if any(b is not None for b in kv) else 2
    axes = fig.subplots(rows, 1, sharex=True)
    for key, ax, title in (("p", axes[0], "probability of the chosen token"), ("H", axes[1], "entropy (nats)")):
        if raw:
            _line(ax, [v[key] for v in tv], "raw", RAW)
        if sampled:
            _line(ax, [v["s" + key] for v in tv], "sampled", SAMPLED)
        ax.set_title(title, fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_ylim(-0.02, 1.02)
    if rows == 3:
        # in the largest whole unit, so the axis reads 16 KiB rather than 16384
        top = max((b for b in kv if b is not None), default=1)
        power = min(3, int(math.log(max(top, 1), 1024)))
        _line(axes[2], [None if b is None else b / 1024**power for b in kv], "KV cache", "#16a34a")
        axes[2].set_title(f"KV-cache bytes ({('B', 'KiB', 'MiB', 'GiB')[power]})", fontsize=9, loc="left")
    axes[-1].set_xlabel(what)


def _branch_axes(fig: Any, traces: list[dict[str, Any]]) -> None:
    top, bottom = fig.subplots(2, 1, sharex=True)
    for k, t in enumerate(traces):
        tv = views.token_views(t["steps"])
        label = t.get("label") or ("original" if k == 0 else f"branch {k}")
        _line(top, [v["p"] for v in tv], label)
        _line(bottom, list(accumulate(-(v["lp"] or 0.0) for v in tv)), label)
    top.set_title("probability of the chosen token", fontsize=9, loc="left")
    top.set_ylim(-0.02, 1.02)
    bottom.set_title("cumulative negative logprob", fontsize=9, loc="left")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.legend(fontsize=7, loc="best")


def plot_png(obj: Any, dpi: int = 110) -> bytes:
    """The figure as PNG bytes; `obj` is anything `render_html` accepts."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    try:
        kind, d = as_record(obj)
    except ValueError as e:
        raise InvalidParameter(f"plot: {e}") from e
    fig = Figure(figsize=(9, 7), layout="constrained")
    if kind == BRANCHES:
        _branch_axes(fig, d["branches"])
        model = d["branches"][0].get("model")
    else:
        _trace_axes(
            fig, views.token_views(d["tokens" if kind == SCORE else "steps"]), "token" if kind == SCORE else "step"
        )
        model = d.get("model")
    source = model.get("source") if isinstance(model, dict) else model
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figure_png(fig, f"lmtrace {kind}: {source or ''}", dpi)


def write_plot(path: str | Path, obj: Any) -> None:
    """Writes `plot_png(obj)` to `path` atomically."""
    write_atomic_bytes(path, plot_png(obj))
