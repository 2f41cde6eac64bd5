"""`lmtrace kld`'s result as one self-contained HTML page: the statistics (as llama-perplexity
--kl-divergence prints them) and the worst positions, the text before each worst position shown
(escaped: model and corpus text are data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from markupsafe import Markup, escape

from lmtrace.files import write_atomic
from lmtrace.render.terminal.kld import summary_rows

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
