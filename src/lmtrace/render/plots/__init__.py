"""matplotlib figures of records as PNG: one module per feature (trace.py for a trace, a score
result or branches; stability.py; kvlab.py). matplotlib is imported only when a figure is drawn.

The trace figure's entry points stay importable from here, as the docs write them (loaded on
first use, as render/html's)."""

from __future__ import annotations

from typing import Any

__all__ = ["plot_png", "write_plot"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lmtrace.render.plots import trace

        return getattr(trace, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
