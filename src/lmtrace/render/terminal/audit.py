"""The audit in the terminal: a line per probe as it finishes, and the summary."""

from __future__ import annotations

from typing import Any

from rich.text import Text

STYLES = {"pass": "bold green", "fail": "bold red", "skip": "dim"}


def probe_line(p: dict[str, Any]) -> Text:
    """`  pass  logprobs      greedy and sampled …` for one probe's dict."""
    line = Text()
    line.append(f"{p['status']:>4}", style=STYLES.get(p["status"], ""))
    line.append(f"  {p['name']:<13}", style="bold")
    line.append(p["detail"], style="" if p["status"] != "skip" else "dim")
    line.append(f"  ({p.get('seconds', 0.0):.1f} s)", style="dim")
    return line


def summary_line(d: dict[str, Any]) -> Text:
    counts = d.get("summary") or {}
    line = Text()
    line.append(f"{d['server']} ({d['served_model']}) against {d['model']}: ", style="bold")
    for status in ("pass", "fail", "skip"):
        line.append(f"{counts.get(status, 0)} {status}", style=STYLES[status] if counts.get(status) else "dim")
        line.append(", " if status != "skip" else "")
    line.append(f" in {d.get('seconds', 0.0):.0f} s (tolerance {d['tolerance']:g} nats)", style="dim")
    return line
