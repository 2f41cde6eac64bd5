"""The stability ledger in the terminal: the reference's text with the flagged tokens marked,
one row per variant, and the flagged tokens with their margin against the noise."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


def plain(text: str) -> str:
    """Text as it reads: spaces and line ends kept, other control characters shown as \\xNN."""
    return "".join(ch if ch in "\n\t" or 32 <= ord(ch) != 127 else f"\\x{ord(ch):02x}" for ch in text)


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def risk_style(step: dict[str, Any], threshold: float) -> str:
    """Flagged: red; risk below twice the threshold: yellow; else plain."""
    if step["flagged"]:
        return "bold black on red"
    risk = step.get("risk")
    return "black on yellow" if risk is not None and risk < 2 * threshold else ""


def marked_text(d: dict[str, Any]) -> Text:
    """The reference's text, each flagged token on red (a token near the line on yellow)."""
    out = Text()
    for step, row in zip(d["reference"]["steps"], d["steps"]):
        out.append(plain(step["text"]), style=risk_style(row, d["threshold"]))
    return out


def variant_table(d: dict[str, Any]) -> Table:
    table = Table(
        title="Each variant against the reference",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
    )
    table.add_column("variant", no_wrap=True)
    for name in ("flips", "max |Δ|", "mean |Δ|", "diverges", "seconds"):
        table.add_column(name, justify="right", no_wrap=True)
    for v in d["variants"]:
        if v["status"] != "ran":
            continue
        t = v.get("timing") or {}
        seconds = sum(t.get(k, 0.0) for k in ("build_ms", "forced_ms", "decode_ms")) / 1000
        div = v["first_divergence"]
        table.add_row(
            Text(v["variant"]),
            str(v["flips"]),
            _num(v["max_abs_delta"], ".2e"),
            _num(v["mean_abs_delta"], ".2e"),
            "never" if div is None else f"step {div}",
            f"{seconds:.1f}",
        )
    return table


def flagged_table(d: dict[str, Any]) -> Table | None:
    rows = [s for s in d["steps"] if s["flagged"]]
    if not rows:
        return None
    table = Table(
        title=f"Flagged tokens (margin < {d['threshold']:g} × sigma)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
    )
    for name in ("step", "token", "runner-up", "margin", "sigma", "risk", "flipped under"):
        table.add_column(name, justify="right" if name in ("step", "margin", "sigma", "risk") else "left")
    for s in rows:
        flips = Text(", ".join(s["flipped_in"]) or "—")
        table.add_row(
            str(s["index"]),
            Text(repr(s["text"])),
            Text(repr(s["runner_up"])),
            _num(s["margin"], ".3g"),
            _num(s["sigma"], ".2g"),
            _num(s["risk"], ".2g"),
            flips,
        )
    return table


def runs_line(d: dict[str, Any]) -> Text | None:
    runs = d.get("runs") or []
    if not runs:
        return None
    same = sum(r["identical"] for r in runs)
    worst = max(r["max_abs_delta"] for r in runs)
    divs = [r["first_divergence"] for r in runs if r["first_divergence"] is not None]
    text = f"{len(runs) + 1} runs of the reference: {same} of {len(runs)} repeats identical, max |Δ| {worst:.2e}"
    return Text(text + (f", first divergence at step {min(divs)}" if divs else ""))


def print_stability(result: Any, console: Console) -> None:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    ref = d["reference"]
    flagged = sum(s["flagged"] for s in d["steps"])
    head = (
        f"{ref['model']['source']}: prompt {len(ref['prompt']['token_ids'])} tokens, reference "
        f"{len(ref['steps'])} tokens; {flagged} flagged (red), near the line (yellow):"
    )
    console.print(Text(head, style="bold"))
    console.print(marked_text(d))
    console.print(variant_table(d))
    for v in d["variants"]:
        if v["status"] != "ran":
            console.print(Text(f"{v['variant']} skipped: {v['reason']}", style="dim"))
    flags = flagged_table(d)
    if flags is not None:
        console.print(flags)
    line = runs_line(d)
    if line is not None:
        console.print(line)
    console.print(
        Text(
            "flips: steps where the variant's top-1 differs from the reference's (teacher-forced); "
            "Δ: change of the reference token's logprob (nats); diverges: first step the variant's own "
            "decoding picks another token; margin: top-1 minus top-2 logprob; sigma: how much the "
            "variants move that gap (the largest over them of the change at the step, or of their usual "
            "change along the text where larger); risk: margin / sigma",
            style="dim",
        )
    )
