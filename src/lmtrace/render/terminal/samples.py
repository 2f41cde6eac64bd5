"""The terminal view of `lmtrace sample`: one row per sample (answer, tokens, stop, confidence),
then the votes and the answer-level scores."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def samples_table(d: dict[str, Any]) -> Table:
    table = Table(title=f"{d['settings']['n']} samples", title_justify="left", show_edge=False)
    for name in ("#", "seed", "answer", "tokens", "finish", "kept", "lowest group", "mean NLL"):
        table.add_column(name, justify="left" if name in ("answer", "finish", "kept") else "right")
    for e in d["samples"]:
        answer = Text(e["answer"] if e["matched"] else "no match", style="" if e["matched"] else "dim")
        finish = e["stopped"] or e["finish_reason"] or "–"
        table.add_row(
            str(e["index"]),
            str(e["seed"]),
            answer,
            str(e["tokens"]),
            finish,
            "yes" if e["kept"] else "no",
            _fmt(e["lowest_group"]),
            _fmt(e["mean_nll"]),
        )
    return table


def print_samples(result: Any, view: Console) -> None:
    d = result.to_dict() if hasattr(result, "to_dict") else result
    view.print(samples_table(d))
    votes = Table(title="votes", title_justify="left", show_edge=False)
    for name in ("vote", "answer", "share"):
        votes.add_column(name)
    for name, v in d["votes"].items():
        votes.add_row(name, _fmt(v["answer"]), _fmt(v["share"]))
    view.print(votes)
    s = d["scores"]
    names = (
        "semantic_entropy",
        "discrete_semantic_entropy",
        "mc_sequence_entropy",
        "mc_normalized_entropy",
        "num_sets",
        "choice_entropy",
    )
    view.print("  ".join(f"{n} {_fmt(s[n], '.4f')}" for n in names if n in s))
    stop = d.get("early_stop")
    if stop:
        view.print(
            f"DeepConf-{stop['mode']}: threshold {stop['threshold']:.4f} (p{stop['percentile']:.0f} of "
            f"{stop['warmup']} warm-up traces), group {stop['group']} tokens, "
            f"consensus {'reached' if stop['consensus_reached'] else 'not reached'}; "
            f"{s['tokens']} tokens"
        )
