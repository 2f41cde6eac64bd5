"""`lmtrace intervene`: a block or a head ablated, a steering vector added, and what that does
to the reference generation token by token (teacher-forced) and free-running."""

from __future__ import annotations

import click

from lmtrace.cli.common import cli, consoles, load_model, read_prompt, write_json
from lmtrace.cli.options import json_indent, json_option, model_options, sampling_options
from lmtrace.cli.reports import check_report_paths, write_reports
from lmtrace.errors import InvalidParameter

_SAMPLING = sampling_options(max_new_tokens=32, temperature=0.0, without=("stop",),
                             help={"seed": "Seed for sampling (every arm gets the same)."})  # fmt: skip


@cli.command("intervene")
@click.argument("prompt", required=False)
@click.option("--prompt-file", default=None, help="Read the prompt from this file.")
@click.option("--ablate", "ablate", multiple=True, metavar="L.attn|L.mlp|L.hH",
              help="An arm with decoder layer L's attention or MLP output zeroed, or head H's output before "
              "the output projection (0-based; repeatable, each its own arm).")  # fmt: skip
@click.option("--steer", "steer", multiple=True, metavar="L:FILE.pt:ALPHA",
              help="An arm adding ALPHA x the vector in FILE.pt to the residual after layer L at every position "
              "(lmtrace steer-vector writes one; repeatable).")  # fmt: skip
@click.option("--patch", "patch", multiple=True, metavar="L:TEXT",
              help="An arm whose residual after layer L at the prompt's last position is TEXT's there "
              "(activation patching; repeatable).")  # fmt: skip
@click.option("--no-free", is_flag=True, help="Skip the free-running arms (teacher-forced numbers only).")
@_SAMPLING
@model_options
@json_option("the comparison")
@click.option("--html", "html_path", default=None, metavar="FILE", help="Write a self-contained HTML report.")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def intervene(prompt, prompt_file, ablate, steer, patch, no_free, json_path, html_path, no_color, **options):
    """Generate from PROMPT, then rerun it under each intervention: per token the reference
    token's logprob change, KL(reference || arm) and top-1 agreement, and where the arm's own
    generation first differs."""
    from lmtrace.params import SamplingParams

    keys = ("model", "device", "dtype", "allow_pickle", "trust_remote_code")
    loading = [options.pop(k) for k in keys]
    chat = options.pop("chat")
    params = SamplingParams(**options)  # checked before loading
    if not ablate and not steer and not patch:
        raise InvalidParameter("intervene: needs at least one --ablate, --steer or --patch, got none")
    text = read_prompt(prompt, prompt_file)
    check_report_paths(html_path, None)
    view, status = consoles(json_path, no_color)
    lm = load_model(status, *loading)
    from lmtrace.interventions import intervene as run
    from lmtrace.render.terminal.intervene import print_arms

    result = run(lm, text, ablate, steer, patch, chat=chat, free=not no_free, params=params)
    write_json(json_path, result.to_json(indent=json_indent()))
    print_arms(result.to_dict(), view)
    if html_path is not None:
        from lmtrace.render.html.intervene import write_intervene_html

        write_reports(result, html_path, None, view, html=write_intervene_html)
