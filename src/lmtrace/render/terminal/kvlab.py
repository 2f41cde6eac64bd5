"""The kv-lab summary in the terminal: one row per policy beside the full-cache reference."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


def human_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def short_bytes(n: float | None) -> str:
    """1.49M, 405K: bytes in three figures for a narrow column."""
    if n is None:
        return "—"
    for unit in ("", "K", "M", "G"):
        if abs(n) < 1000 or unit == "G":
            return f"{n:.3g}{unit}"
        n /= 1024
    return f"{n:.3g}G"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def reference_perplexity(d: dict[str, Any]) -> float | None:
    import math

    lps = [s["logprob"] for s in d["reference"]["steps"] if s.get("logprob") is not None]
    return math.exp(-sum(lps) / len(lps)) if lps else None


def lab_table(d: dict[str, Any]) -> Table:
    """`d` is LabResult.to_dict(); compact enough for an 80-column terminal."""
    table = Table(
        title="KV-cache lab: each policy against the full cache",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
    )
    table.add_column("policy", no_wrap=True)
    for name in ("kept", "bytes", "KL", "max", "top1", "ppl", "div", "evict"):
        table.add_column(name, justify="right", no_wrap=True)
    ref_bytes = d["reference_bytes"][-1] if d["reference_bytes"] else None
    table.add_row(
        "full (reference)",
        "100%",
        short_bytes(ref_bytes),
        "0",
        "0",
        "100%",
        _num(reference_perplexity(d), ".3g"),
        "—",
        "—",
        style="dim",
    )
    for arm in d["arms"]:
        s = arm["summary"]
        div = s.get("divergence_step")
        table.add_row(
            Text(arm["policy"]),
            _num(None if s["bytes_fraction"] is None else 100 * s["bytes_fraction"], ".0f") + "%",
            short_bytes(s.get("bytes_final")),
            _num(s["mean_kl"], ".3f"),
            _num(s["max_kl"], ".2f"),
            _num(None if s["top1_agreement"] is None else 100 * s["top1_agreement"], ".0f") + "%",
            _num(s["perplexity"], ".3g"),
            "—" if div is None else str(div),
            _num(s.get("mean_evicted_mass"), ".2f"),
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
            console.print(
                Text(f"{arm['policy']} alone from step {free['divergence_step']}: ", style="bold")
                + Text(repr(free["text"][:200]))
            )
    console.print(
        Text(
            "kept: bytes measured on the arm's tensors / the full cache's, mean over steps; bytes: at "
            "the last step; KL(full || arm) in nats, mean and max; top1: steps where the arm's top token "
            "is the reference's; ppl: perplexity of the reference tokens; div: first step the arm's own "
            "choice differs; evict: attention the full cache put on positions the arm had evicted",
            style="dim",
        )
    )
