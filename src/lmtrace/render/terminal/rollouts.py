"""The rollouts report in the terminal: the summary metrics, the caps, the causes with their
figures, and the rollouts that disagree most."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmtrace.render.terminal.stability import plain

WORST = 5  # rollouts listed


def _n(x: float | None, spec: str = ".2e") -> str:
    return "—" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}%"


def summary_table(report: dict[str, Any]) -> Table:
    s = report["summary"]
    table = Table(
        title=f"{s['sequences']} rollouts, {s['tokens']} tokens; trainer: {report['trainer']}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("k1", "k2", "k3", "mean |Δ|", "ppl_ratio", "outside [0.9, 1.1]", "flagged"):
        table.add_column(name, justify="right")
    table.add_row(
        _n(s["k1"]),
        _n(s["k2"]),
        _n(s["k3"]),
        _n(s["mean_abs_delta"]),
        _n(s["ppl_ratio"], ".6f"),
        _pct(s["outside_0_9_1_1"]),
        str(s["flagged"]),
    )
    return table


def caps_table(report: dict[str, Any]) -> Table:
    table = Table(title="TIS / MIS caps", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("cap", "tokens clipped", "tokens masked", "sequences masked"):
        table.add_column(name, justify="right")
    for c in report["summary"]["caps"]:
        table.add_row(f"{c['cap']:g}", _pct(c["tokens_clipped"]), _pct(c["tokens_masked"]), _pct(c["sequences_masked"]))
    return table


def _figures(evidence: dict[str, Any]) -> str:
    parts = []
    for k, v in evidence.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:.3g}")
        elif isinstance(v, (int, str)):
            parts.append(f"{k} {v}")
    return ", ".join(parts)


def print_rollouts(report: dict[str, Any], console: Console) -> None:
    console.print(summary_table(report))
    if report["summary"]["caps"]:
        console.print(caps_table(report))
    causes = report["summary"]["causes"]
    if report["summary"].get("bitwise_equal"):
        console.print("Bitwise equal: every engine logprob is the teacher-forced one, bit for bit (every Δ 0.0).")
    elif not causes:
        console.print("No cause: every rollout's engine logprobs fit the teacher-forced ones.")
    for c in causes:
        console.print(Text(f"{c['cause']}: {c['sequences']} rollouts", style="bold red"))
    worst = sorted(
        report["rollouts"],
        key=lambda r: (
            -max((abs(t["residual"]) if t["residual"] is not None else 1e9 for t in r["tokens"]), default=0.0)
        ),
    )
    for r in worst[:WORST]:
        if not r["causes"]:
            continue
        for c in r["causes"]:
            line = Text(f"{r['id']}: {c['cause']}" + (f" ({c['detail']})" if c["detail"] else ""), style="bold")
            line.append(f"  {_figures(c['evidence'])}", style="dim")
            console.print(line)
        console.print(Text(plain("".join(t["text"] for t in r["tokens"]))[:200], style="dim"))
    loc = report.get("locate")
    if loc:
        jump = loc["largest_jump"]
        console.print(
            f"locate {loc['variant']} at {loc['rollout']} #{loc['index']}: first over {loc['threshold']}: "
            f"{loc['first_over'] or 'none'}; largest jump {jump['layer']} (+{jump['jump']:.3g})",
            markup=False,
            highlight=False,
        )
