"""`lmtrace kv-lab`: what compressing the KV cache costs, token by token: one reference with the
full cache and one teacher-forced arm per --policy."""

from __future__ import annotations

import click

from lmtrace.cli.common import cli, consoles, load_model, read_prompt, read_text, write_json
from lmtrace.cli.options import json_indent, json_option, model_options, sampling_options
from lmtrace.cli.reports import check_report_paths, write_reports
from lmtrace.errors import InvalidParameter

POLICY_HELP = (
    "A cache policy (repeatable): full, window:size=32, streaming:sinks=4,window=32, h2o:budget=0.25, "
    "snapkv:budget=0.25,window=8, tova:budget=0.25, knorm:budget=0.25, fp8, int4, int2 "
    "(a budget below 1 is a fraction of the positions seen, a whole number a count)."
)


# the lab measures a reference decoding: greedy unless asked, and its length follows --continuation
_LAB_SAMPLING = sampling_options(
    max_new_tokens=None,
    temperature=0.0,
    without=("stop",),
    help={
        "max_new_tokens": "Reference tokens: generated (default 32), or the first N of --continuation (default all).",
        "seed": "Seed for sampling (every arm gets the same).",
    },
)


@cli.command("kv-lab")
@click.argument("prompt", required=False)
@click.option("--prompt-file", default=None, help="Read the prompt from this file.")
@click.option("--policy", "policies", multiple=True, metavar="SPEC", help=POLICY_HELP)
@click.option("--continuation", default=None, help="Teacher-force this text as the reference instead of generating.")
@click.option("--continuation-file", default=None, help="Read --continuation from this file.")
@click.option("--free", is_flag=True, help="Also let each arm generate alone from the step its choice diverges.")
@click.option("--map-step", type=int, default=None, help="Step of the layer x position map (default: the last).")
@_LAB_SAMPLING
@model_options
@json_option("the lab")
@click.option("--html", "html_path", default=None, metavar="FILE", help="Write a self-contained HTML report.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png", help="Write a PNG: KL, logprob change, bytes.")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def kv_lab(prompt, prompt_file, policies, continuation, continuation_file, free, map_step, json_path, html_path,
           plot_path, no_color, **options):  # fmt: skip
    """Compare KV-cache policies with the full cache on PROMPT, step by step: the reference
    token's logprob under each policy, KL(full || policy), top-1 agreement, rank, the attention
    mass on evicted positions, positions kept per layer and bytes measured on the tensors."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lmtrace.kvlab import kvlab, parse_policies
    from lmtrace.params import SamplingParams
    from lmtrace.render.terminal.kvlab import print_lab

    keys = ("model", "device", "dtype", "allow_pickle", "trust_remote_code")
    loading = [options.pop(k) for k in keys]
    chat = options.pop("chat")
    limit = options.pop("max_new_tokens")
    params = SamplingParams(max_new_tokens=32 if limit is None else limit, **options)  # checked before loading
    chosen = parse_policies(list(policies))
    if continuation is not None or continuation_file is not None:
        continuation = read_text(continuation, continuation_file, "continuation", "continuation-file", "")
    text = read_prompt(prompt, prompt_file)
    if map_step is not None and map_step < 0:
        raise InvalidParameter(f"map-step must be >= 0, got {map_step}")
    check_report_paths(html_path, plot_path)
    view, status = consoles(json_path, no_color)
    lm = load_model(status, *loading)
    columns = [TextColumn("Comparing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=status, transient=True) as progress:
        task = progress.add_task("lab", total=None)

        def advance(index: int, total: int) -> None:
            progress.update(task, completed=index + 1, total=total)

        result = kvlab(lm, text, chosen, continuation=continuation, max_continuation_tokens=limit, chat=chat,
                       free=free, map_step=map_step, params=params, on_step=advance)  # fmt: skip
    write_json(json_path, result.to_json(indent=json_indent()))
    print_lab(result, view)
    if html_path is not None or plot_path is not None:
        from lmtrace.render.html.kvlab import write_lab_html
        from lmtrace.render.plots.kvlab import write_lab_plot

        write_reports(result, html_path, plot_path, view, html=write_lab_html, plot=write_lab_plot)
