"""`lmtrace sample`: N seeded samples of a prompt as one batch, their answers, votes and
answer-level uncertainty, and DeepConf's online early stop."""

from __future__ import annotations

import click

from lmtrace.cli.common import cli, consoles, load_model, read_prompt, write_json
from lmtrace.cli.confidence import confidence_options, settings_from
from lmtrace.cli.options import (
    batch_invariant_option,
    json_indent,
    json_option,
    model_options,
    params_from,
    sampling_options,
)
from lmtrace.cli.reports import check_report_paths
from lmtrace.errors import InvalidParameter


@cli.command("sample")
@click.argument("prompt", required=False)
@click.option("--prompt-file", default=None, help="Read the prompt from this file.")
@click.option("-n", "n", type=int, default=16, show_default=True, help="Samples, seeds SEED, SEED+1, ...")
@click.option("--answer-regex", default=None, metavar="RE", help="The answer: the first group (else the match) of "
              "RE's first match; a sample where it never matches has no answer.")  # fmt: skip
@click.option("--choice", multiple=True, metavar="TEXT", help="Constrain each sample to one of these options "
              "(repeatable): the answer, with the options' exact probabilities.")  # fmt: skip
@click.option("--deepconf", type=click.Choice(["low", "high"]), default=None,
              help="DeepConf's online early stop: low keeps the top 10% (90th-percentile threshold), "
              "high the top 90%.")  # fmt: skip
@click.option("--warmup", type=int, default=None, help="Warm-up traces decoded in full to set the threshold "
              "(default: a quarter of -n).")  # fmt: skip
@click.option("--consensus", type=float, default=0.95, show_default=True,
              help="Stop sampling once the kept traces' weighted vote gives one answer this share.")  # fmt: skip
@click.option("--max-batch", type=int, default=16, show_default=True, help="Rows decoded together at most.")
@confidence_options(flag=False)
@sampling_options(without=("stop",))
@model_options
@batch_invariant_option
@json_option("the samples, votes and traces")
@click.option("--html", "html_path", default=None, metavar="FILE", help="Write the samples side by side as HTML.")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def sample_command(prompt, prompt_file, n, answer_regex, choice, deepconf, warmup, consensus, max_batch, json_path,
                   html_path, no_color, **options):  # fmt: skip
    """N samples of PROMPT decoded as one batch, each with its confidence; the answers, majority
    and DeepConf's confidence-weighted votes, semantic entropy, and with --deepconf the online
    early stop (every kept trace token-identical to its seed decoded alone)."""
    if n < 1:
        raise InvalidParameter(f"n must be >= 1, got {n}")
    if answer_regex is not None and choice:
        raise InvalidParameter("--answer-regex and --choice: give one or the other (a choice is its own answer)")
    from lmtrace.samples import answers, settings

    answers.compile_regex(answer_regex)
    settings.check(deepconf, warmup, n, consensus)
    confidence = settings_from(options)
    keys = ("model", "device", "dtype", "allow_pickle", "trust_remote_code")
    loading = [options.pop(k) for k in keys]
    invariant = options.pop("batch_invariant")
    chat = options.pop("chat")
    params = params_from(options)
    text = read_prompt(prompt, prompt_file)
    check_report_paths(html_path, None)
    view, status = consoles(json_path, no_color)
    lm = load_model(status, *loading, batch_invariant=invariant)

    from lmtrace.render.terminal.samples import print_samples
    from lmtrace.samples.run import sample

    with status.status(f"Sampling {n}…") as spinner:
        done: list[int] = []

        def on_row(i: int, trace) -> None:
            done.append(i)
            spinner.update(f"Sampling: {len(done)} done…")

        result = sample(lm, text, n, params, answer_regex=answer_regex, choice=choice, deepconf=deepconf,
                        warmup=warmup, consensus=consensus, chat=chat, max_batch=max_batch,
                        confidence_k=confidence["k"], confidence_window=confidence["window"],
                        confidence_tail=confidence["tail"],
                        on_row=on_row)  # fmt: skip
    write_json(json_path, result.to_json(indent=json_indent()))
    print_samples(result, view)
    if html_path is not None:
        from lmtrace.render.html.samples import write_samples_html

        write_samples_html(html_path, result)
        view.print(f"[dim]page written to {html_path}[/dim]", soft_wrap=True)
