"""`lmtrace kld`'s result for a person: the terminal's statistics (as llama-perplexity
--kl-divergence prints them) and the worst positions, and one self-contained HTML page with the
same, the text before each worst position shown (escaped: model and corpus text are data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from markupsafe import Markup, escape
from rich.console import Group
from rich.table import Table
from rich.text import Text

from lmtrace.files import write_atomic

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


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>KL divergence: {title}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 64rem; padding: 0 1rem; color: #1f2937; }}
table {{ border-collapse: collapse; margin: 0.5rem 0 1.5rem; }}
th, td {{ padding: 0.2rem 0.6rem; border-bottom: 1px solid #e5e7eb; text-align: left; vertical-align: top; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
.ctx {{ font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; color: #4b5563; }}
mark {{ background: #fecaca; }}
</style></head><body>
<h1>KL divergence over a corpus</h1>
<p><b>A</b> {a}<br><b>B</b> {b}<br>{tokens} positions scored: {chunks} chunks of {ctx} tokens, the second
half of each (as <code>llama-perplexity --kl-divergence</code>).</p>
<h2>Statistics</h2>
<table><tbody>{stats}</tbody></table>
<h2>Worst positions</h2>
<table><thead><tr><th>position</th><th>KLD</th><th>p A</th><th>p B</th><th>top A</th><th>top B</th>
<th>the text before it, then the token</th></tr></thead><tbody>{worst}</tbody></table>
</body></html>
"""


def html(r: dict[str, Any]) -> str:
    """The page (every text escaped)."""
    stats = Markup("").join(
        Markup('<tr><th>{}</th><td class="n">{}</td></tr>').format(k, v) for k, v in summary_rows(r)
    )
    rows = Markup("").join(
        Markup(
            '<tr><td class="n">{}</td><td class="n">{:.4f}</td><td class="n">{:.4f}</td><td class="n">{:.4f}</td>'
            '<td>{}</td><td>{}</td><td class="ctx">…{}<mark>{}</mark></td></tr>'
        ).format(
            w["position"],
            w["kld"],
            w["p_a"],
            w["p_b"],
            repr(w["top_a"]["text"]),
            repr(w["top_b"]["text"]),
            w["context"],
            w["token"],
        )
        for w in r["worst"]
    )
    return PAGE.format(
        title=escape(r["a"]),
        a=escape(r["a"]),
        b=escape(r["b"]),
        tokens=f"{r['tokens']:,}",
        chunks=r["chunks"],
        ctx=r["ctx"],
        stats=stats,
        worst=rows,
    )


def write_html(r: dict[str, Any], path: str | Path) -> None:
    write_atomic(Path(path), html(r))
