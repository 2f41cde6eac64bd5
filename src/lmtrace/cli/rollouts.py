"""`lmtrace rollouts FILE.jsonl`: does my trainer agree with my engine? Each rollout's ids
teacher-forced, per token the raw, processed, engine's and trainer's logprobs, the frameworks'
metrics, the TIS/MIS caps, the causes with their figures, and with --locate the first layer
where the reference and a variant part."""

from __future__ import annotations

import click

from lmtrace.cli.common import cli, consoles, load_model, write_json
from lmtrace.cli.options import batch_invariant_option, json_indent, json_option, model_options
from lmtrace.cli.reports import check_report_paths
from lmtrace.errors import InvalidParameter

FORMATS = ("lmtrace", "trl", "verl", "vllm", "openai")
SPEC_HELP = ("dtype:bfloat16, dtype:float16, lm_head:float32, weights:packed, attention:eager, batch:N, threads:N, "
             "compile, model:PATH")


@cli.command("rollouts")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", default="lmtrace", show_default=True, metavar="|".join(FORMATS),
              help="The file's format: lmtrace's own, TRL's or verl's batch dump, vLLM's RequestOutput, "
              "OpenAI-style logprobs.content with token ids (docs/rollouts.md says each mapping).")  # fmt: skip
@click.option("--trainer", default=None, metavar="SPEC", help="The trainer's side as a stability variant "
              f"({SPEC_HELP}); default: the reference's own float32 numbers.")  # fmt: skip
@click.option("--cap", "caps", multiple=True, type=float, metavar="C",
              help="A TIS/MIS cap (repeatable): the share of tokens and sequences it would clip or mask.")  # fmt: skip
@click.option("--locate", default=None, metavar="SPEC", help="Compare the reference and this variant layer by "
              "layer at the worst flagged token (dtype:, weights:, attention:, threads:, model:).")  # fmt: skip
@click.option("--locate-threshold", type=float, default=0.01, show_default=True,
              help="The relative difference of hidden states at which --locate says two computations part.")
@model_options
@batch_invariant_option
@json_option("the report")
@click.option("--html", "html_path", default=None, metavar="FILE", help="Write a self-contained HTML report.")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def rollouts_command(file, fmt, trainer, caps, locate, locate_threshold, json_path, html_path, no_color, **options):
    """Does my trainer agree with my engine? Read FILE (JSON lines of rollouts: prompt and
    completion ids, the engine's logprob of each, the sampling settings), teacher-force every
    rollout (float32, batched; a GRPO group's prompt once) and report per token the raw,
    processed, engine's and trainer's logprobs (engine − raw = processing + residual), k1/k2/k3,
    mean |Δ|, ppl_ratio, the share of ratios outside [0.9, 1.1], each --cap's clipped and
    masked shares, and the causes: off_by_one, retokenized, processing_mismatch, numeric, weights."""
    from lmtrace.scoring.rollouts import options as checks
    from lmtrace.scoring.rollouts import readers
    from lmtrace.scoring.variants.spec import parse_variant

    if fmt not in FORMATS:
        raise InvalidParameter(f"format: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    checks.check_caps(list(caps))
    if trainer is not None:
        parse_variant(trainer)
    if locate is not None:
        checks.check_locate(parse_variant(locate))
    checks.check_threshold(locate_threshold)
    check_report_paths(html_path, None)
    records = readers.read_file(file, fmt)  # the whole file checked before the model loads
    keys = ("model", "device", "dtype", "allow_pickle", "trust_remote_code")
    view, status = consoles(json_path, no_color)
    invariant = options.pop("batch_invariant")
    lm = load_model(status, *[options.pop(k) for k in keys], batch_invariant=invariant)

    from lmtrace.render.terminal.rollouts import print_rollouts
    from lmtrace.scoring.rollouts.report import rollouts

    with status.status("Teacher-forcing the rollouts…") as spinner:
        report = rollouts(lm, records, trainer=trainer, caps=caps, locate=locate, fmt=fmt,
                          locate_threshold=locate_threshold, on_status=lambda s: spinner.update(f"{s}…"))  # fmt: skip
    from lmtrace.scoring.rollouts.report import to_json

    write_json(json_path, to_json(report, indent=json_indent()))
    print_rollouts(report, view)
    if html_path is not None:
        from lmtrace.render.html.rollouts import write_rollouts_html

        write_rollouts_html(html_path, report)
        view.print(f"[dim]report written to {html_path}[/dim]", soft_wrap=True)
