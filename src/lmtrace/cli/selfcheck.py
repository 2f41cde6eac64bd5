"""A self-check that failed while this command ran ends it with exit code 1 and one line on stderr
(`lmtrace: error: ...`), after the trace has been shown and written: never `error:` and exit 0.
A trace read back from a file (`lmtrace render`) shows the same finding as a warning: its check
failed when it was made."""

from __future__ import annotations

from lmtrace.errors import LmtraceError
from lmtrace.records import Trace


class SelfCheckFailed(LmtraceError):
    """lmtrace's own numbers disagree with each other (exit code 1)."""


def kv_checked(trace: Trace) -> None:
    """Raises SelfCheckFailed when the measured KV bytes differed from the formula at some step."""
    steps = (trace.kv_anatomy or {}).get("mismatches")
    if steps:
        raise SelfCheckFailed(
            f"measured KV bytes differ from the formula at steps {steps}: the formula "
            "(lmtrace.kv.ledger.layer_layout) does not describe this cache; the trace is "
            "written, its per-layer `kv` shows where"
        )
