"""`lmtrace audit`: a live checkup of an OpenAI-compatible server's logprobs against the model's
own numbers (teacher forcing the server's tokens), probe by probe.

    server = connect("http://127.0.0.1:8000")          # no torch yet: bad input fails fast
    report = audit(lmtrace.load(), server)              # AuditReport: .probes, .exit_code, .to_dict()

The names are imported when first used, so `connect` and the argument checks cost no torch."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "AuditReport": "lmtrace.comparison.audit.result",
    "ProbeResult": "lmtrace.comparison.audit.result",
    "DEFAULT_TOLERANCE": "lmtrace.comparison.audit.connect",
    "PROBE_NAMES": "lmtrace.comparison.audit.connect",
    "Server": "lmtrace.comparison.audit.connect",
    "check_probes": "lmtrace.comparison.audit.connect",
    "check_tolerance": "lmtrace.comparison.audit.connect",
    "connect": "lmtrace.comparison.audit.connect",
    "PROBES": "lmtrace.comparison.audit.runner",
    "audit": "lmtrace.comparison.audit.runner",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'lmtrace.comparison.audit' has no attribute {name!r}")
