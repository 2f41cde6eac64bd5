"""The terminal view of a scored text (rich): totals, the text coloured by each token's
probability, one table row per token. Also used for a trace's echoed prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from lmtrace.records import TokenScore
from lmtrace.render.terminal.trace import legend
from lmtrace.render.tokens import colour, escape, prob, show_bytes


def _cell(t: TokenScore) -> str:
    own = show_bytes(t.bytes)
    return own if escape(t.text) == own else f"{own} → {escape(t.text) or '…'}"


def tokens_table(tokens: Sequence[TokenScore], width: int = 100, first_index: int = 0) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    fixed = {"no_wrap": True, "justify": "right"}
    table.add_column("#", style="dim", min_width=2, **fixed)
    table.add_column("token", no_wrap=True, min_width=12, overflow="ellipsis")
    table.add_column("prob", min_width=5, **fixed)
    table.add_column("rank", min_width=4, **fixed)
    table.add_column("entropy", min_width=7, **fixed)
    # rich squeezes narrow columns away when one cell is too wide: bound the widest one
    table.add_column("alternatives", no_wrap=True, overflow="ellipsis", max_width=max(12, width - 40))
    for i, t in enumerate(tokens, start=first_index):
        if t.logprob is None:  # the first token of a sequence: nothing predicted it
            table.add_row(str(i), Text(_cell(t), style="dim"), "—", "—", "—", Text("no context", style="dim"))
            continue
        p = prob(t.logprob)
        alts = Text()
        for c in t.top:
            if c.token_id == t.token_id:
                continue
            cp = prob(c.logprob)
            alts.append(show_bytes(c.bytes), style=colour(cp))
            alts.append(f" {cp:.3f}  ", style="dim")
        table.add_row(str(i), Text(_cell(t), style=colour(p)), f"{p:.3f}", str(t.rank), f"{t.entropy:.2f}", alts)
    return table


def coloured(tokens: Sequence[TokenScore], prompt: str | None = None) -> Text:
    out = Text()
    if prompt:
        out.append(prompt, style="dim")
    for t in tokens:
        out.append(t.text, style="dim" if t.logprob is None else colour(prob(t.logprob)))
    return out


def header(result: Any) -> Text:
    out = Text()
    out.append(result.model["source"], style="bold")
    out.append(f"  {result.model['dtype']} on {result.model['device']}\n", style="dim")
    out.append(f"{result.scored_tokens} tokens scored")
    if result.prompt is not None:
        out.append(f" (continuation; prompt {len(result.prompt_token_ids)} tokens)")
    out.append(f", total logprob {result.total_logprob:.4f}")
    if result.perplexity is not None:
        out.append(f", perplexity {result.perplexity:.4g}, {result.bits_per_byte:.4f} bits/byte")
    total = len(result.prompt_token_ids) + len(result.token_ids)
    if total > result.window:
        out.append(f"\nsliding window {result.window}, stride {result.stride}", style="dim")
    return out


def view(result: Any, width: int = 100) -> Group:
    """`result` is a lmtrace.score.ScoreResult (not imported: renderers need no torch)."""
    first = len(result.prompt_token_ids)
    return Group(
        header(result),
        Text(),
        coloured(result.tokens, result.prompt),
        Text(),
        legend(),
        Text(),
        tokens_table(result.tokens, width, first),
    )


def print_score(result: Any, console: Console | None = None) -> None:
    console = console or Console()
    console.print(view(result, console.width))


def summary_table(rows: Sequence[tuple[Any, Any]], limit: int = 20) -> Table:
    """One row per (id, ScoreResult) of a batch, the first `limit` of them."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("id", "tokens", "total logprob", "perplexity", "bits/byte"):
        table.add_column(name, justify="left" if name == "id" else "right", no_wrap=True)
    for key, r in rows[:limit]:
        ppl = "—" if r.perplexity is None else f"{r.perplexity:.4g}"
        bpb = "—" if r.bits_per_byte is None else f"{r.bits_per_byte:.4f}"
        table.add_row(str(key), str(r.scored_tokens), f"{r.total_logprob:.4f}", ppl, bpb)
    return table
