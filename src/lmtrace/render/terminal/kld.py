"""`lmtrace kld`'s result in the terminal: the statistics (as llama-perplexity --kl-divergence
prints them) and the worst positions. The rows (`summary_rows`) are the HTML page's too."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

KLD_ROWS = (
    ("max", "Maximum KLD"),
    ("p99_9", "99.9%   KLD"),
    ("p99", "99.0%   KLD"),
    ("median", "Median  KLD"),
    ("mean", "Mean    KLD"),
)
DP_ROWS = (
    ("p99", "99.0%"),
    ("p95", "95.0%"),
    ("p90", "90.0%"),
    ("p75", "75.0%"),
    ("median", "Median"),
    ("p25", "25.0%"),
    ("p10", "10.0%"),
    ("p5", " 5.0%"),
    ("p1", " 1.0%"),
)


def summary_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) of every statistic, in llama.cpp's order and formats."""
    rows = [
        ("Mean PPL(A)", f"{r['ppl_a']:.6f}"),
        ("Mean PPL(B)", f"{r['ppl_b']:.6f}"),
        ("Mean PPL(B)/PPL(A)", f"{r['ppl_ratio']:.6f}"),
    ]
    rows += [(label, f"{r['kld'][k]:.6f}") for k, label in KLD_ROWS]
    rows += [(f"{label} Δp", f"{100 * r['delta_p'][k]:.3f}%") for k, label in DP_ROWS]
    rows += [("Same top p", f"{100 * r['same_top']:.3f}%")]
    return rows


def _visible(text: str) -> str:
    """Control characters and newlines shown as escapes (\\n), so one row stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def terminal(r: dict[str, Any]) -> Group:
    from lmtrace.render.anatomy import title

    where = Text(
        f"{r['tokens']:,} positions scored: {r['chunks']} chunks of {r['ctx']} tokens, the second half of each",
        style="dim",
    )
    stats = Table.grid(padding=(0, 2))
    stats.add_column(style="cyan", no_wrap=True)
    stats.add_column(justify="right", no_wrap=True)
    for label, value in summary_rows(r):
        stats.add_row(label, value)
    worst = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("position", "KLD", "token", "p A", "p B", "top A / top B", "before it"):
        worst.add_column(
            name, justify="right" if name in ("position", "KLD", "p A", "p B") else "left", overflow="fold"
        )
    for w in r["worst"]:  # Text cells: the corpus's and the model's "[...]" are not markup
        cells = (
            str(w["position"]),
            f"{w['kld']:.4f}",
            repr(w["token"]),
            f"{w['p_a']:.3g}",
            f"{w['p_b']:.3g}",
            f"{_visible(w['top_a']['text'])!r} / {_visible(w['top_b']['text'])!r}",
            "…" + _visible(w["context"][-40:]),
        )
        worst.add_row(*(Text(c) for c in cells))
    return Group(
        title("A", r["a"]),
        title("B", r["b"]),
        where,
        Text(),
        stats,
        Text(),
        Text("Worst positions (largest KL(A‖B))", style="bold"),
        worst,
    )
