"""`lmtrace audit URL`: a live OpenAI-compatible server's logprobs against the model's own."""

from __future__ import annotations

import click

from lmtrace.cli.common import cli, consoles, load_model, write_json
from lmtrace.cli.options import json_indent, json_option, model_options
from lmtrace.cli.reports import check_report_paths
from lmtrace.comparison.audit.connect import (
    DEFAULT_TOLERANCE,
    MAX_TOKENS,
    PROBE_NAMES,
    check_probes,
    check_tolerance,
    connect,
)
from lmtrace.errors import InvalidParameter


@cli.command()
@click.argument("url")
@model_options
@click.option("--served-model", default=None, metavar="NAME",
              help="The model id the requests name. Default: the first of the server's /v1/models.")  # fmt: skip
@click.option("--api-key", default=None, envvar="LMTRACE_API_KEY", metavar="KEY",
              help="Sent as Authorization: Bearer KEY (or set LMTRACE_API_KEY).")  # fmt: skip
@click.option("--probe", "probes", multiple=True, metavar="NAME",
              help=f"Run this probe (repeatable; default all): {', '.join(PROBE_NAMES)}.")  # fmt: skip
@click.option("--tolerance", type=float, default=DEFAULT_TOLERANCE, show_default=True,
              help="The largest |Δ logprob| (nats) that counts as equal; ~0.2 for a bfloat16 server.")  # fmt: skip
@click.option("--max-tokens", type=int, default=MAX_TOKENS, show_default=True, help="Tokens per generation.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait for one answer.")
@json_option("the report")
@click.option("--html", "html_path", default=None, metavar="FILE", help="Write the report as an HTML page.")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def audit(url, model, device, dtype, allow_pickle, trust_remote_code, served_model, api_key, probes, tolerance,
          max_tokens, timeout, json_path, html_path, no_color):  # fmt: skip
    """Audit the logprobs of a live OpenAI-compatible server (vLLM, llama.cpp, SGLang, lmtrace
    serve …) that serves --model's weights: each probe sends real requests and compares what
    comes back with the model's own numbers for the same tokens. Exit 0 when every probe passes
    or is skipped, 1 when one fails, 2 for bad input or a server that cannot be audited."""
    names = check_probes(probes)
    tolerance = check_tolerance(tolerance)
    if max_tokens < 4:
        raise InvalidParameter(f"max_tokens must be >= 4, got {max_tokens}")
    if not timeout > 0:
        raise InvalidParameter(f"timeout must be > 0 seconds, got {timeout}")
    check_report_paths(html_path, None)
    server = connect(url, api_key=api_key, served_model=served_model, timeout=timeout)  # before torch
    view, status = consoles(json_path, no_color)
    # the oracle in float32 unless told otherwise (auto would be bfloat16 on CUDA): one forward pass each
    lm = load_model(status, model, device, "float32" if dtype == "auto" else dtype, allow_pickle, trust_remote_code)

    from lmtrace.comparison.audit.runner import audit as run
    from lmtrace.render.terminal.audit import probe_line, summary_line

    def show(result) -> None:
        view.print(probe_line(result.to_dict()), soft_wrap=True)

    with status.status("Auditing…"):
        report = run(lm, server, probes=names, tolerance=tolerance, max_tokens=max_tokens, on_probe=show)
    write_json(json_path, report.to_json(indent=json_indent()))
    if html_path is not None:
        from lmtrace.render.html.audit import write_audit_html

        write_audit_html(html_path, report)
        status.print(f"[dim]report written to {html_path}[/dim]", soft_wrap=True)
    view.print(summary_line(report.to_dict()), soft_wrap=True)
    return report.exit_code
