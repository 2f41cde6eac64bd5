"""Check the logprobs another engine reported against the model's own (see core.compare), and
audit a live server's (see audit). The names are imported when first used (PEP 562), so that
`lmtrace audit`'s argument checks and its connection check run before torch is imported."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "Comparison": "lmtrace.comparison.core",
    "compare": "lmtrace.comparison.core",
    "Reported": "lmtrace.comparison.parse",
    "parse_response": "lmtrace.comparison.parse",
}
__all__ = ["Comparison", "Reported", "compare", "parse_response"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'lmtrace.comparison' has no attribute {name!r}")
