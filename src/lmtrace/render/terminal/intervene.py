"""The terminal view of `lmtrace intervene`: one summary row per arm (mean and max KL, top-1
agreement, mean Δlogprob, where the free run diverges) and each arm's free-running text."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmtrace.render.tokens import escape


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def arms_table(d: dict[str, Any]) -> Table:
    table = Table(
        box=None,
        pad_edge=False,
        header_style="bold",
        title_justify="left",
        title="interventions against the reference (teacher-forced on its tokens)",
    )
    for name, justify in (
        ("intervention", "left"),
        ("mean KL", "right"),
        ("max KL", "right"),
        ("top-1 agree", "right"),
        ("mean Δlogprob", "right"),
        ("diverges at", "right"),
    ):
        table.add_column(name, justify=justify)
    for arm in d["arms"]:
        s = arm["summary"]
        div = s.get("divergence_step")
        agree = s.get("top1_agreement")
        table.add_row(
            arm["intervention"],
            _fmt(s.get("mean_kl"), ".4f"),
            _fmt(s.get("max_kl"), ".4f"),
            "—" if agree is None else f"{100 * agree:.1f}%",
            _fmt(s.get("mean_delta"), "+.4f"),
            "never" if div is None else f"step {div}",
        )
    return table


def effect_table(arm: dict[str, Any], reference_steps: list[dict[str, Any]]) -> Table:
    """Per token of the reference: its logprob under the arm, the change, KL, top-1 agreement."""
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left", title=arm["intervention"])
    for name in ("step", "token", "logprob", "Δ", "KL", "top-1"):
        table.add_column(name, justify="left" if name == "token" else "right")
    for step, ref in zip(arm["steps"], reference_steps):
        agree = "yes" if step["top1_agree"] else "no"
        table.add_row(
            str(step["index"]),
            Text(repr(escape(ref.get("text", "")))),
            _fmt(step["logprob"], ".3f"),
            _fmt(step["delta"], "+.3f"),
            _fmt(step["kl"], ".4f"),
            agree,
        )
    return table


def print_arms(d: dict[str, Any], view: Console, steps: bool = False) -> None:
    """The summary table, then each arm's free-running text where it diverged."""
    view.print(Text("reference: ", style="bold") + Text(escape(d["reference"].get("text", ""))))
    view.print(arms_table(d))
    for arm in d["arms"]:
        if steps:
            view.print(effect_table(arm, d["reference"]["steps"]))
        free = arm.get("free")
        if free and free.get("first_divergence") is not None:
            view.print(
                Text(f"{arm['intervention']} (free from step {free['first_divergence']}): ", style="bold")
                + Text(escape(free["text"]))
            )
