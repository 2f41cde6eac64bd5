"""`lmtrace cache` and `lmtrace kv-size`: the KV cache explained, measured and predicted."""

from __future__ import annotations

import json

import click
from rich.console import Group
from rich.text import Text

from lmtrace.cli.common import announce, cli, consoles, load_model, read_prompt, write_json
from lmtrace.cli.generate import progress_bar, traced_remotely
from lmtrace.cli.options import json_indent, json_option, model_options, params_from, sampling_options
from lmtrace.cli.remote import server_option
from lmtrace.cli.reports import check_report_paths, report_options, write_reports
from lmtrace.errors import InvalidParameter


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=str, default=None, help="Read the prompt from this file.")
@model_options
@sampling_options
@click.option("--demo-misuse", is_flag=True, help="Run a right and a re-feeding hand-written loop side by side.")
@click.option("--rounds", type=int, default=6, show_default=True, help="Rounds of each loop for --demo-misuse.")
@json_option("the ledger")
@report_options
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
@server_option
def cache(prompt, prompt_file, model, device, dtype, allow_pickle, trust_remote_code, demo_misuse, rounds, json_path,
          html_path, plot_path, no_color, server, **kw):  # fmt: skip
    """Generate from PROMPT and show the KV cache: its dimensions, its size per step, its growth."""
    params = params_from(kw)
    if rounds < 1:
        raise InvalidParameter(f"rounds must be >= 1, got {rounds}")
    check_report_paths(html_path, plot_path)
    text = read_prompt(prompt, prompt_file, kw["chat"])
    view, status = consoles(json_path, no_color)
    local = {"device": device, "dtype": dtype, "allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code,
             "demo_misuse": demo_misuse}  # fmt: skip
    if server:
        trace = traced_remotely(server, model, local, text, params, kw["chat"], {}, status)
    else:
        announce(status, model)
        from lmtrace.decode.tracing import generate as run

        lm = load_model(status, model, device, dtype, allow_pickle, trust_remote_code)
        if demo_misuse:
            _demo(lm, text, kw["chat"], rounds, json_path, view, status)
            return
        with progress_bar(status, params.max_new_tokens) as progress:
            task = progress.add_task("generate", total=params.max_new_tokens)
            trace = run(lm, text, params, chat=kw["chat"], on_step=lambda row, step: progress.advance(task))
    _show(trace, json_path, view)
    write_reports(trace, html_path, plot_path, view)
    if (trace.kv_anatomy or {}).get("mismatches"):
        raise click.exceptions.Exit(1)


def _demo(lm, text: str, chat: bool, rounds: int, json_path: str | None, view, status) -> None:
    """--demo-misuse: a right and a re-feeding hand-written loop side by side."""
    from lmtrace.decode.tracing import encode_prompt
    from lmtrace.external.misuse import compare
    from lmtrace.render.terminal.kv import misuse_view

    with status.status("Running both loops…"):
        result = compare(lm, encode_prompt(lm, text, chat), rounds)
    write_json(json_path, json.dumps(result, indent=json_indent()))
    view.print(misuse_view(result))


def _show(trace, json_path: str | None, view) -> None:
    """The ledger as JSON; the anatomy, the generated text, the steps and the growth chart."""
    from lmtrace.render.terminal.kv import anatomy_view, chart, steps_view
    from lmtrace.render.terminal.trace import coloured_text

    ledger = [s.kv for s in trace.steps]
    record = {"model": trace.model, "anatomy": trace.kv_anatomy, "steps": ledger}
    write_json(json_path, json.dumps(record, indent=json_indent()))
    an = trace.kv_anatomy or {}
    if "unsupported" in an:
        view.print(Text(an["unsupported"], style="yellow"))
    else:
        last = ledger[-1] if ledger else {}
        measured = last.get("bytes_used", last.get("bytes"))
        view.print(anatomy_view(an, trace.model["source"], last.get("seq_len"), measured))
    view.print(Group(Text(), Text("generated", style="bold"), coloured_text(trace), Text()))
    view.print(Group(steps_view(ledger), Text(), Text("KV cache bytes per step", style="bold"),
                     chart([k["bytes"] for k in ledger])))  # fmt: skip


@cli.command("kv-size")
@click.argument("model_or_config", required=False)
@click.option("--context", type=int, required=True, help="Positions (prompt + generated tokens) per sequence.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences decoded together.")
@click.option("--dtype", default="auto", show_default=True,
              help="Cache dtype: auto (the config's, else float32), float32, float16, bfloat16, float8.")  # fmt: skip
@click.option("--trust-remote-code", is_flag=True, help="Run the model repository's own Python code.")
@json_option("the result")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def kv_size(model_or_config, context, batch, dtype, trust_remote_code, json_path, no_color):
    """KV-cache size of MODEL_OR_CONFIG (config.json, a folder, a .gguf, a hub id; default the
    bundled model) at --context positions, from the config alone: no weights are loaded."""
    from lmtrace.kv.size import anatomy, context_table
    from lmtrace.model.load import load_config
    from lmtrace.render.terminal.kv import anatomy_view, size_view

    if context < 1:
        raise InvalidParameter(f"context must be >= 1, got {context}")
    if batch < 1:
        raise InvalidParameter(f"batch must be >= 1, got {batch}")
    config = load_config(model_or_config, trust_remote_code=trust_remote_code)
    an = anatomy(config, config_dtype(config) if dtype == "auto" else dtype, batch)
    max_context = getattr(config.get_text_config(), "max_position_embeddings", None)
    result = {
        "model": model_or_config or "bundled SmolLM2-135M-Instruct",
        "context": context,
        "batch": batch,
        "dtype": an.dtype,
        "bytes_per_token": an.bytes_per_token,
        "bytes_per_token_full": an.bytes_per_token_full,
        "growth_at_context": an.growth_at(context),
        "total_bytes": an.bytes_at(context),
        "max_context": max_context,
        "anatomy": an.to_dict(),
        "table": [{"context": r["context"], "bytes": r["bytes"] // batch} for r in context_table(an, max_context)],
    }
    write_json(json_path, json.dumps(result, indent=json_indent()))
    view, _ = consoles(json_path, no_color)
    view.print(anatomy_view(an.to_dict(), result["model"], context))
    view.print(size_view(result))
    if max_context and context > max_context:
        view.print(f"[yellow]note: context {context} is beyond the model's maximum of {max_context} positions[/yellow]")


def config_dtype(config) -> str:
    """The dtype a config declares for its weights (the cache has the model's dtype), else float32."""
    declared = str(getattr(config, "dtype", None) or "float32")
    declared = declared.replace("torch.", "")
    return declared if declared in ("float32", "float16", "bfloat16") else "float32"
