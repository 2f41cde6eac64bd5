"""`lmtrace branch`: decode once, then again with the token at one step replaced by an
alternative, and show the decodings side by side."""

from __future__ import annotations

import click

from lmtrace.cli import remote
from lmtrace.cli.common import announce, cli, consoles, load_draft, load_model, read_prompt, write_json
from lmtrace.cli.options import (
    draft_from,
    draft_options,
    inside_options,
    json_indent,
    json_option,
    model_options,
    params_from,
    sampling_options,
)
from lmtrace.cli.remote import server_option
from lmtrace.cli.reports import check_report_paths, report_options, write_reports
from lmtrace.errors import InvalidParameter
from lmtrace.params import check_integer


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=str, default=None, help="Read the prompt from this file.")
@click.option("--at", "at", type=int, required=True, help="The step (0-based) whose token is replaced.")
@click.option(
    "--alternative",
    "alternatives",
    type=int,
    multiple=True,
    help="Rank of the replacing token under the raw distribution (2 = the runner-up; repeatable). Default 2.",
)
@click.option("--fan", type=int, default=None, help="Branch on each of the K most likely tokens instead.")
@model_options
@sampling_options
@json_option('{"branches": [trace, ...]}')
@report_options
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
@inside_options
@draft_options
@server_option
def branch(prompt, prompt_file, at, alternatives, fan, json_path, html_path, plot_path, no_color, server, **kw):
    """Decode PROMPT, then again with the token at step --at replaced by the K-th most likely
    token, continuing with the same settings (the shared prefix's cache is reused)."""
    loading = [kw.pop(k) for k in ("model", "device", "dtype", "allow_pickle", "trust_remote_code")]
    params = params_from(kw)  # argument errors before torch is imported
    draft, draft_tokens = draft_from(kw)
    check_integer("at", at, low=0, high=params.max_new_tokens - 1)
    if alternatives and fan is not None:
        raise InvalidParameter("alternative: give --alternative or --fan, not both")
    text = read_prompt(prompt, prompt_file, kw["chat"])
    check_report_paths(html_path, plot_path)
    view, status = consoles(json_path, no_color)
    fields = {"prompt": text, "at": at, "alternatives": list(alternatives) or None, "fan": fan, "chat": kw["chat"],
              "lens": kw["lens"], "attention": kw["attention"]}  # fmt: skip
    if server:
        keys = ("device", "dtype", "allow_pickle", "trust_remote_code")
        base = remote.check(server, loading[0], dict(zip(keys, loading[1:])))
        with status.status("Decoding and branching on the server…"):
            result = remote.branch(base, loading[0], fields, params)
    else:
        announce(status, loading[0])
        from lmtrace.decode.branch import branch as run

        lm = load_model(status, *loading)
        chosen = load_draft(status, lm, draft)
        with status.status("Decoding and branching…"):
            result = run(lm, text, at, fields["alternatives"], fan=fan, params=params, chat=kw["chat"],
                         lens=kw["lens"], attention=kw["attention"], draft=chosen,
                         draft_tokens=draft_tokens)  # fmt: skip
    from lmtrace.render.terminal.branch import print_branches

    write_json(json_path, result.to_json(indent=json_indent()))
    print_branches(result, view)
    write_reports(result, html_path, plot_path, view)
    if json_path and json_path != "-":
        view.print(f"[dim]branches written to {json_path}[/dim]")
