"""The kv-lab PNG: KL(full || policy), the reference token's logprob change, and the cache
bytes measured per step, one line per policy (Figure + Agg, no pyplot)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmtrace.files import write_atomic_bytes
from lmtrace.render.plots.trace import PALETTE, figure_png


def lab_png(result: Any, dpi: int = 110) -> bytes:
    from matplotlib.figure import Figure

    d = result.to_dict() if hasattr(result, "to_dict") else result
    fig = Figure(figsize=(9, 8), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    xs = list(range(len(d["reference_bytes"])))
    axes[2].plot(xs, [b / 1024 for b in d["reference_bytes"]], color="#111", linewidth=1.2, label="full cache")
    for i, arm in enumerate(d["arms"]):
        colour = PALETTE[i % len(PALETTE)]
        steps = arm["steps"]
        for ax, key in zip(axes, ("kl", "delta")):
            ax.plot(range(len(steps)), [s[key] for s in steps], color=colour, linewidth=1.2, label=arm["policy"])
        axes[2].plot(
            range(len(steps)), [s["bytes"] / 1024 for s in steps], color=colour, linewidth=1.2, label=arm["policy"]
        )
    titles = ("KL(full ‖ policy), nats", "change of the reference token's logprob (nats)", "KV-cache bytes (KiB)")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    source = (d["reference"].get("model") or {}).get("source", "")
    return figure_png(fig, f"lmtrace kv-lab: {source}", dpi)


def write_lab_plot(path: str | Path, result: Any) -> None:
    write_atomic_bytes(path, lab_png(result))
