"""The audit as an HTML page: one row per probe (its status, what it found, its figures), and for
a failure or a skip the evidence a user can paste into an upstream issue: the request as a curl
line, what came back, lmtrace's own numbers. One self-contained file, no script; every text
from the server goes through Jinja's autoescaping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmtrace.files import write_atomic
from lmtrace.render.html.templating import env

EVIDENCE_CHARS = 20000  # a pasted issue stays readable; the JSON report holds it all


def _figures(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, value) rows, one per figure; nested figures as compact JSON."""
    rows = []
    for key, value in figures.items():
        if key == "problems":
            continue
        if isinstance(value, float):
            text = f"{value:.4g}"
        elif isinstance(value, (dict, list)):
            text = json.dumps(value, ensure_ascii=False, default=str)
        else:
            text = "—" if value is None else str(value)
        rows.append((key, text))
    return rows


def _evidence(evidence: dict[str, Any] | None) -> dict[str, str] | None:
    if not evidence:
        return None
    rest = {k: v for k, v in evidence.items() if k != "curl"}
    text = json.dumps(rest, ensure_ascii=False, indent=2, default=str)
    if len(text) > EVIDENCE_CHARS:
        text = text[:EVIDENCE_CHARS] + f"\n… ({len(text) - EVIDENCE_CHARS} more characters in the JSON report)"
    return {"curl": evidence.get("curl") or "", "json": text}


def render_audit_html(report: Any) -> str:
    """The page for an AuditReport or its dict."""
    d = report.to_dict() if hasattr(report, "to_dict") else report
    probes = [
        {
            "name": p["name"],
            "status": p["status"],
            "detail": p["detail"],
            "problems": (p.get("figures") or {}).get("problems") or [],
            "figures": _figures(p.get("figures") or {}),
            "evidence": _evidence(p.get("evidence")),
            "seconds": f"{p.get('seconds', 0.0):.1f}",
        }
        for p in d["probes"]
    ]
    return (
        env()
        .get_template("audit.html.j2")
        .render(
            server=d["server"],
            served_model=d.get("served_model", ""),
            model=d["model"],
            tolerance=d.get("tolerance"),
            summary=d.get("summary") or {},
            preflight=d.get("preflight") or {},
            seconds=f"{d.get('seconds', 0.0):.1f}",
            probes=probes,
            versions=d.get("versions") or {},
        )
    )


def write_audit_html(path: str | Path, report: Any) -> None:
    write_atomic(path, render_audit_html(report))
