"""HTML views of records: one module per feature (trace.py the report every record kind shares,
stability.py, kvlab.py, ...), with the page's pieces (templating, sections, facts, svg charts).

The report's entry points stay importable from here, as the docs write them; loaded on first use,
so that a shared module (render/views.py, render/speculative.py) can import one of this package's
pieces without loading the whole report."""

from __future__ import annotations

from typing import Any

__all__ = ["notebook_html", "render_html", "write_html"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lmtrace.render.html import trace

        return getattr(trace, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
