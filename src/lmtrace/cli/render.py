"""`lmtrace render TRACE.json`: a saved trace (or score result, or branches) shown again in the
terminal, or written as an HTML report or a PNG plot. No model is loaded."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from lmtrace.cli.common import cli
from lmtrace.cli.reports import check_report_paths, report_options, write_reports
from lmtrace.errors import InvalidParameter
from lmtrace.records import Trace
from lmtrace.render.kinds import BRANCHES, SCORE, STABILITY, read_record


def _trace(d: dict[str, Any], path: str) -> Trace:
    try:
        return Trace.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidParameter(f"trace: {path!r} is not a whole trace ({type(e).__name__}: {e})") from e


def _print_score(d: dict[str, Any], console: Console) -> None:
    from lmtrace.render.tokens import colour, prob

    text = Text()
    for t in d["tokens"]:
        lp = t.get("logprob")
        text.append(t.get("text", ""), style="dim" if lp is None else colour(prob(lp)))
    console.print(text)
    ppl = d.get("perplexity")
    shown = "–" if ppl is None else f"{ppl:.4g}"  # a one-token text has nothing scored
    console.print(f"perplexity {shown} over {len(d['tokens'])} tokens")


def print_record(kind: str, d: dict[str, Any], path: str, console: Console, show_prompt: bool = False) -> None:
    """The terminal view: the same as `generate` showed for a trace; each branch in turn."""
    from lmtrace.render.terminal.trace import print_trace

    if kind == SCORE:
        _print_score(d, console)
    elif kind == STABILITY:
        from lmtrace.render.terminal.stability import print_stability

        print_stability(d, console)
    elif kind == BRANCHES:
        for k, t in enumerate(d["branches"]):
            console.print(Rule(t.get("label") or ("original" if k == 0 else f"branch {k}")))
            print_trace(_trace(t, path), console, show_prompt)
    else:
        print_trace(_trace(d, path), console, show_prompt)


def _print_lens(kind: str, d: dict[str, Any], path: str, step: int | None, console: Console) -> None:
    from lmtrace.render.terminal.inside import inside_table, pick_step, settled_line

    if kind != "trace":
        raise InvalidParameter(f"lens: {path!r} is a {kind} record, not a trace")
    trace = _trace(d, path)
    chosen = pick_step(trace, step)
    if any(s.lens for s in trace.steps):
        console.print(settled_line(trace))
    positions = len(trace.prompt.get("token_ids") or []) + chosen.index  # what the step's query sees
    recent = ((trace.params or {}).get("attention") or {}).get("recent", 32)
    console.print(inside_table(chosen, positions, recent))


@cli.command()
@click.argument("trace_path", metavar="TRACE.json")
@report_options
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
@click.option("--lens", "lens", is_flag=True, help="A layer table of one step (--step): logit lens and attention.")
@click.option("--step", "step", type=int, default=None, help="Show this step's layer table (as --lens; default 0).")
@click.option("--show-prompt", is_flag=True, help="Show the whole prompt the model saw (a chat template's included).")
def render(trace_path, html_path, plot_path, no_color, lens=False, step=None, show_prompt=False):
    """Show a saved TRACE.json (from --json) again, or write it as an HTML report (--html) or a
    PNG plot (--plot). Also reads score results, branches and stability ledgers."""
    check_report_paths(html_path, plot_path)
    kind, d = read_record(trace_path)
    console = Console(no_color=no_color, highlight=False)
    if lens or step is not None:  # --step alone shows that step's layers too
        _print_lens(kind, d, trace_path, step, console)
        return
    if html_path is None and plot_path is None:
        print_record(kind, d, trace_path, console, show_prompt)
        return
    if kind == STABILITY:
        from lmtrace.render.html.stability import write_stability_html
        from lmtrace.render.plots.stability import write_stability_plot

        write_reports(d, html_path, plot_path, console, html=write_stability_html, plot=write_stability_plot)
        return
    write_reports(d, html_path, plot_path, console)
