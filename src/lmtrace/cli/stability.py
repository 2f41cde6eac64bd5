"""`lmtrace stability`: will this token flip? The reference decoded once, then its tokens
teacher-forced and the prompt decoded again under each --variant; per step the margin against
the noise the variants show."""

from __future__ import annotations

import click

from lmtrace.cli.common import cli, consoles, load_model, read_prompt, write_json
from lmtrace.cli.options import (
    batch_invariant_option,
    json_indent,
    json_option,
    model_options,
    params_from,
    sampling_options,
)
from lmtrace.cli.reports import check_report_paths, report_options, write_reports
from lmtrace.errors import InvalidParameter
from lmtrace.scoring.variants import spec as variant_spec

VARIANT_HELP = (
    "A variant (repeatable): dtype:bfloat16, dtype:float16, weights:packed, attention:eager, attention:sdpa, "
    "batch:N, threads:N, compile, engine:vllm, model:PATH (another file of the same model). "
    f"Default: {', '.join(variant_spec.DEFAULT)}. One that cannot run here is reported skipped."
)

# the ledger asks about a deployment's decoding: greedy and 32 tokens unless told otherwise
_STABILITY_SAMPLING = sampling_options(
    max_new_tokens=32,
    temperature=0.0,
    help={"seed": "Seed for sampling (the reference, every variant and every run get the same)."},
)


@cli.command("stability")
@click.argument("prompt", required=False)
@click.option("--prompt-file", default=None, help="Read the prompt from this file.")
@click.option("--variant", "variants", multiple=True, metavar="SPEC", help=VARIANT_HELP)
@click.option("--runs", type=int, default=1, show_default=True, help="Decode the reference this many times in all "
              "(run-to-run determinism on this machine).")  # fmt: skip
@click.option(
    "--threshold",
    type=float,
    default=2.0,
    show_default=True,
    help="Flag a step whose margin is below THRESHOLD × sigma (see docs/stability.md for its calibration).",
)
@_STABILITY_SAMPLING
@model_options
@batch_invariant_option
@json_option("the ledger")
@report_options
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def stability_command(prompt, prompt_file, variants, runs, threshold, json_path, html_path, plot_path, no_color,
                      **options):  # fmt: skip
    """Will this token flip? Decode PROMPT, then under each variant (another dtype, packed
    weights, another attention kernel, a batch, a thread count, torch.compile, vLLM, another
    file of the model) teacher-force its tokens (logprob change, top-1 flips) and decode it
    again (the first step that differs). Each token's margin (top-1 minus top-2 logprob) is set
    against the noise the variants show at that step; the tokens at risk are flagged."""
    specs = variant_spec.parse_variants(list(variants) or list(variant_spec.DEFAULT))
    if runs < 1:
        raise InvalidParameter(f"runs must be >= 1, got {runs}")
    if not threshold > 0 or threshold == float("inf"):
        raise InvalidParameter(f"threshold must be a number > 0, got {threshold}")
    keys = ("model", "device", "dtype", "allow_pickle", "trust_remote_code")
    loading = [options.pop(k) for k in keys]
    invariant = options.pop("batch_invariant")
    chat = options.pop("chat")
    params = params_from(options)  # checked before the model loads
    text = read_prompt(prompt, prompt_file)
    check_report_paths(html_path, plot_path)
    view, status = consoles(json_path, no_color)
    lm = load_model(status, *loading, batch_invariant=invariant)

    from lmtrace.render.terminal.stability import print_stability
    from lmtrace.scoring.stability.ledger import stability

    with status.status("Decoding the reference…") as spinner:
        result = stability(lm, text, specs, runs=runs, threshold=threshold, chat=chat, params=params,
                           on_status=lambda line: spinner.update(f"Running {line}…"))  # fmt: skip
    write_json(json_path, result.to_json(indent=json_indent()))
    print_stability(result, view)
    if html_path is not None or plot_path is not None:
        from lmtrace.render.html.stability import write_stability_html
        from lmtrace.render.plots.stability import write_stability_plot

        write_reports(result, html_path, plot_path, view, html=write_stability_html, plot=write_stability_plot)
