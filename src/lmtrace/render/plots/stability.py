"""The stability ledger's PNG (Figure + Agg, no pyplot): per step the margin against threshold x
sigma on a log scale, flagged steps in red; below it each variant's |Δ| of the reference token's
logprob, its flips marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmtrace.files import write_atomic_bytes
from lmtrace.render.html.stability import FLOOR
from lmtrace.render.plots.trace import PALETTE, figure_png

NAN = float("nan")


def stability_png(result: Any, dpi: int = 110) -> bytes:
    from matplotlib.figure import Figure

    d = result.to_dict() if hasattr(result, "to_dict") else result
    steps, threshold = d["steps"], d["threshold"]
    fig = Figure(figsize=(9, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    xs = [s["index"] for s in steps]
    top.plot(
        xs,
        [max(s["margin"], FLOOR) if s["margin"] is not None else NAN for s in steps],
        "o",
        color="#111",
        markersize=3.5,
        label="margin (top-1 − top-2 logprob)",
    )
    top.plot(
        xs,
        [threshold * s["sigma"] if s["sigma"] else NAN for s in steps],
        color="#2563eb",
        linewidth=1.2,
        label=f"{threshold:g} × sigma (how much the variants move the gap)",
    )
    flagged = [s for s in steps if s["flagged"] and s["margin"] is not None]
    top.plot(
        [s["index"] for s in flagged],
        [max(s["margin"], FLOOR) for s in flagged],
        "o",
        color="#dc2626",
        markersize=6,
        label="flagged",
    )
    top.set_yscale("log")
    top.set_title("margin against noise per step (nats, log scale)", fontsize=9, loc="left")
    for i, v in enumerate(x for x in d["variants"] if x["status"] == "ran"):
        colour = PALETTE[i % len(PALETTE)]
        values = [max(abs(s["delta"]), FLOOR) if s["delta"] is not None else NAN for s in v["steps"]]
        bottom.plot(range(len(values)), values, color=colour, linewidth=1.1, label=v["variant"])
        flips = [s["index"] for s in v["steps"] if s["flipped"]]
        bottom.plot(flips, [values[j] for j in flips], "x", color=colour, markersize=7)
    bottom.set_yscale("log")
    bottom.set_title(
        "|Δ| of the reference token's logprob per variant (× where its top-1 flipped)", fontsize=9, loc="left"
    )
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    source = (d["reference"].get("model") or {}).get("source", "")
    return figure_png(fig, f"lmtrace stability: {source}", dpi)


def write_stability_plot(path: str | Path, result: Any) -> None:
    write_atomic_bytes(path, stability_png(result))
