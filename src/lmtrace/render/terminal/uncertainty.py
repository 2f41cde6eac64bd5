"""The terminal view of a trace's uncertainty: one table of the sequence scores, raw beside
processed where the trace was sampled."""

from __future__ import annotations

from typing import Any

from rich.table import Table

# (label, key in the trace's uncertainty, key inside `deepconf` or None)
ROWS = [
    ("max sequence prob. (−Σ log p)", "msp", None),
    ("mean NLL (−mean log p)", "mean_nll", None),
    ("perplexity", "perplexity", None),
    ("mean entropy", "mean_entropy", None),
    ("max entropy", "max_entropy", None),
    ("DeepConf mean confidence", "deepconf", "mean"),
    ("DeepConf bottom-10% group", "deepconf", "bottom10"),
    ("DeepConf lowest group", "deepconf", "lowest_group"),
    ("DeepConf tail", "deepconf", "tail"),
]


def number(value: Any) -> str:
    return "–" if value is None else f"{value:.4f}"


def value(u: dict, key: str, inner: str | None, prefix: str = "") -> Any:
    found = u.get(prefix + key)
    return found.get(inner) if inner is not None and isinstance(found, dict) else found


def scores_table(u: dict[str, Any]) -> Table:
    """The sequence scores of `trace.uncertainty` (higher: more uncertain, except DeepConf's)."""
    sampled = "sampled_msp" in u
    s = u.get("settings", {})
    title = f"How sure was the model? (k {s.get('k')}, window {s.get('window')}, tail {s.get('tail')})"
    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column("score")
    table.add_column("raw", justify="right")
    if sampled:
        table.add_column("processed", justify="right")
    for label, key, inner in ROWS:
        cells = [label, number(value(u, key, inner))]
        if sampled:
            cells.append(number(value(u, key, inner, "sampled_")))
        table.add_row(*cells)
    table.add_row("RenyiNeg (−mean D½ to uniform, T 2)", number(u.get("renyi_neg")), *([""] if sampled else []))
    table.add_row("FisherRao (−mean distance, T 2)", number(u.get("fisher_rao")), *([""] if sampled else []))
    low = u.get("lowest_token")
    if low:
        where = f"{low['text']!r} at step {low['index']} (logprob {low['logprob']:.4f})"
        table.add_row("least likely token", where, *([""] if sampled else []))
    return table
