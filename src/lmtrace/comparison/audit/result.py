"""What an audit finds: one ProbeResult per probe (pass, fail or skip, a one-line detail, its
figures and, for a failure, the evidence), and the report that holds them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("pass", "fail", "skip")


@dataclass
class ProbeResult:
    name: str
    status: str  # pass | fail | skip
    detail: str  # one line: what was checked and what came out, or why the probe was skipped
    figures: dict[str, Any] = field(default_factory=dict)
    # for a failure: the request (as JSON and as a curl line), what came back, and lmtrace's numbers
    evidence: dict[str, Any] | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "status": self.status, "detail": self.detail, "figures": clean(self.figures)}
        if self.evidence is not None:
            d["evidence"] = clean(self.evidence)
        d["seconds"] = round(self.seconds, 3)
        return d


@dataclass
class AuditReport:
    server: str  # the server's base URL
    served_model: str  # the model id it serves (its /v1/models)
    model: str  # the weights lmtrace's own numbers come from
    tolerance: float
    probes: list[ProbeResult] = field(default_factory=list)
    preflight: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        return {s: sum(p.status == s for p in self.probes) for s in STATUSES}

    @property
    def exit_code(self) -> int:
        """0 when every probe passed or was skipped, 1 when one failed."""
        return 1 if any(p.status == "fail" for p in self.probes) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "served_model": self.served_model,
            "model": self.model,
            "tolerance": self.tolerance,
            "summary": self.counts(),
            "probes": [p.to_dict() for p in self.probes],
            "preflight": clean(self.preflight),
            "versions": self.versions,
            "seconds": round(self.seconds, 3),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=indent, allow_nan=False)


def clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null (JSON has no inf or NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value
