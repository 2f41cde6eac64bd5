"""The kv-lab summary in the terminal: one row per policy beside the full-cache reference."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def human_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def reference_perplexity(d: dict[str, Any]) -> float | None:
    import math

    lps = [s["logprob"] for s in d["reference"]["steps"] if s.get("logprob") is not None]
    return math.exp(-sum(lps) / len(lps)) if lps else None


def lab_table(d: dict[str, Any]) -> Table:
    """`d` is LabResult.to_dict()."""
    table = Table(title="KV-cache lab: each policy against the full cache", title_justify="left")
    for name, justify in (("policy", "left"), ("cache kept", "right"), ("bytes (last step)", "right"),
                          ("mean KL", "right"), ("max KL", "right"), ("top-1 agree", "right"),
                          ("perplexity", "right"), ("diverges at", "right"), ("evicted attn", "right")):  # fmt: skip
        table.add_column(name, justify=justify)
    ref_bytes = d["reference_bytes"][-1] if d["reference_bytes"] else None
    table.add_row("reference (full cache)", "100%", human_bytes(ref_bytes), "0", "0", "100%",
                  _num(reference_perplexity(d), ".3f"), "—", "—", style="dim")  # fmt: skip
    for arm in d["arms"]:
        s = arm["summary"]
        div = s.get("divergence_step")
        table.add_row(
            Text(arm["policy"]),
            _num(None if s["bytes_fraction"] is None else 100 * s["bytes_fraction"], ".1f") + "%",
            human_bytes(s.get("bytes_final")),
            _num(s["mean_kl"], ".4f"),
            _num(s["max_kl"], ".4f"),
            _num(None if s["top1_agreement"] is None else 100 * s["top1_agreement"], ".1f") + "%",
            _num(s["perplexity"], ".3f"),
            "never" if div is None else f"step {div}",
            _num(s.get("mean_evicted_mass"), ".3f"),
        )
    return table


def print_lab(result: Any, console: Console) -> None:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    ref = d["reference"]
    how = "teacher-forced text" if d.get("teacher_forced") else "generated"
    head = f"prompt {d['prompt_tokens']} tokens; reference {len(ref['steps'])} tokens ({how}):"
    console.print(Text(head, style="bold"))
    console.print(Text(ref["text"][:400] + ("…" if len(ref["text"]) > 400 else "")))
    console.print(lab_table(d))
    for arm in d["arms"]:
        free = arm.get("free")
        if free and free["divergence_step"] is not None:
            console.print(Text(f"{arm['policy']} alone from step {free['divergence_step']}: ", style="bold")
                          + Text(repr(free["text"][:200])))  # fmt: skip
    console.print(Text("cache kept: the arm's measured bytes / the full cache's, mean over steps; evicted attn: "
                       "attention the full cache put on positions the arm had evicted (mean over layers, steps)",
                       style="dim"))  # fmt: skip
