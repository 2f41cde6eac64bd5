"""The terminal view of a step's sampling waterfall: one row per stage, with the tokens the raw
model ranked highest followed through every stage (a dash where a stage removed one)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from lmtrace.records import Step
from lmtrace.render.tokens import colour, escape, show_bytes


def _setting(stage: dict[str, Any]) -> str:
    if stage["stage"] == "raw":
        return ""
    if stage["stage"] == "grammar":
        return str(stage["setting"] or "").replace("_", " ")
    if not stage["applied"]:
        return "off" if stage["stage"] != "temperature" or stage["setting"] != 0 else "greedy"
    setting = stage["setting"]
    if isinstance(setting, dict):  # a logit bias, {token id: bias}: the first two
        shown = ", ".join(f"{k}:{v:+g}" for k, v in list(setting.items())[:2])
        return shown + (f" +{len(setting) - 2}" if len(setting) > 2 else "")
    return setting if isinstance(setting, str) else f"{setting:g}"  # a user's processor: "user"


def stages_table(step: Step) -> Table:
    """One row per stage: its setting, tokens still allowed, mass removed, entropy, and the
    chosen token's probability and rank."""
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
    table.title = Text(f"step {step.index}: {escape(step.text) or '…'} — the distribution after each stage")
    fixed = {"no_wrap": True, "justify": "right"}
    table.add_column("stage", no_wrap=True)
    for name in ("setting", "allowed", "removed", "entropy", "p(chosen)", "rank"):
        table.add_column(name, **fixed)
    for stage in step.waterfall or []:
        table.add_row(
            Text(stage["stage"].replace("_", " "), style="" if stage["applied"] else "dim"),
            _setting(stage),
            str(stage["allowed"]),
            f"{stage['removed_mass']:.3f}",
            f"{stage['entropy']:.2f}",
            Text(f"{stage['chosen_prob']:.3f}", style=colour(stage["chosen_prob"])),
            "—" if stage["chosen_rank"] is None else str(stage["chosen_rank"]),
        )
    return table


def tokens_table(step: Step) -> Table:
    """The raw model's most likely tokens followed through the stages: a dash where one was removed."""
    stages = step.waterfall or []
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("raw rank", justify="right", no_wrap=True)
    table.add_column("token", no_wrap=True, overflow="ellipsis", max_width=16)
    for stage in stages:
        short = {"repetition_penalty": "penalty", "temperature": "temp"}.get(stage["stage"], stage["stage"])
        table.add_column(short.replace("_", "-"), justify="right", no_wrap=True)
    own_bytes = {a.token_id: a.bytes for a in step.top}  # byte pieces show as <0xNN> where known
    for i, token in enumerate(stages[0]["tokens"] if stages else [], start=1):
        raw = own_bytes.get(token["token_id"])
        text = show_bytes(raw) if raw is not None else escape(token["text"])
        mark = " ◀" if token["token_id"] == step.token_id else ""
        row = [str(i), Text(f"{text or '…'}{mark}", style="bold" if mark else "")]
        for stage in stages:
            p = stage["tokens"][i - 1]["prob"]
            row.append(Text("—", style="red") if p == 0.0 else Text(f"{p:.3f}", style=colour(p)))
        table.add_row(*row)
    return table


def waterfall_view(step: Step) -> Group:
    return Group(stages_table(step), Text(), tokens_table(step))
