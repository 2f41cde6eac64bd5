"""`lmtrace generate`: trace a generation and show it."""

from __future__ import annotations

import sys
from contextlib import ExitStack

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from lmtrace.arguments import step_selector
from lmtrace.cli import remote
from lmtrace.cli.common import announce, cli, consoles, load_draft, load_model, read_prompt
from lmtrace.cli.confidence import confidence_options, settings_from
from lmtrace.cli.options import (
    attribution_options,
    batch_invariant_option,
    check_compile_kernels,
    check_compile_packed,
    constraint_options,
    device_map_option,
    draft_from,
    draft_options,
    inside_options,
    json_indent,
    json_option,
    matmul_option,
    model_options,
    params_from,
    sampling_options,
    weights_option,
)
from lmtrace.cli.remote import server_option
from lmtrace.cli.reports import check_folder, check_report_paths, report_options, write_reports
from lmtrace.cli.selfcheck import kv_checked
from lmtrace.errors import InvalidParameter
from lmtrace.records import Trace


def print_extras(trace, waterfall: str | None, view) -> None:
    """The echoed prompt tokens and the chosen step's waterfall, below the trace."""
    from rich.text import Text

    from lmtrace.render.terminal.score import tokens_table
    from lmtrace.render.terminal.waterfall import waterfall_view

    if trace.prompt_logprobs is not None:
        view.print(Text("\nprompt tokens (teacher-forced in the prefill pass)", style="bold"))
        view.print(tokens_table(trace.prompt_logprobs, view.width))
    if waterfall is None:
        return
    if waterfall == "all":
        view.print("[dim]\nwaterfall recorded at every step (in the JSON)[/dim]")
        return
    step = next((s for s in trace.steps if s.index == int(waterfall)), None)
    if step is None:
        view.print(f"[dim]\nwaterfall: the decoding stopped before step {waterfall}[/dim]")
    else:
        view.print(Text())
        view.print(waterfall_view(step))


class RateColumn(ProgressColumn):
    """Tokens per second over the last steps (rich's own estimate of the task's speed)."""

    def render(self, task) -> Text:
        return Text("" if task.speed is None else f"{task.speed:.1f} tok/s", style="progress.data.speed")


def progress_bar(console, total: int) -> Progress:
    columns = [TextColumn("Generating"), BarColumn(), MofNCompleteColumn(), RateColumn(), TimeElapsedColumn()]
    # off where stderr is not a terminal: rich would leave an empty line there
    return Progress(*columns, console=console, transient=True, disable=not console.is_terminal)


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=str, default=None, help="Read the prompt from this file.")
@model_options
@device_map_option
@sampling_options
@constraint_options
@json_option("the trace")
@click.option(
    "--jsonl",
    "jsonl_path",
    default=None,
    metavar="FILE",
    help="Write the trace as JSON Lines: a header line, one line per step as it comes, a closing line.",
)
@click.option(
    "--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token (to --max-new-tokens)."
)
@report_options
@weights_option
@matmul_option
@batch_invariant_option
@click.option("--compile", "compile_", is_flag=True,
              help="Static cache + torch.compile'd decode step: a one-off compile, the same tokens.")  # fmt: skip
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
@click.option("--echo", is_flag=True, help="Also record the prompt tokens' logprobs (from the prefill pass).")
@click.option(
    "--waterfall", default=None, metavar="STEP|all", help="Record the distribution after each sampling stage."
)
@inside_options
@confidence_options
@attribution_options
@draft_options
@server_option
@click.option("--show-prompt", is_flag=True, help="Show the whole prompt the model saw (with --chat: the template's "
              "system prompt and turn markers).")  # fmt: skip
def generate(prompt, prompt_file, model, device, dtype, allow_pickle, trust_remote_code, json_path, no_color, **kw):
    """Generate from PROMPT and show every token's probability, rank, entropy and alternatives."""
    params = params_from(kw)  # argument errors first: they need no torch
    html_path, plot_path = kw.pop("html_path"), kw.pop("plot_path")
    check_report_paths(html_path, plot_path)
    step_selector(kw["waterfall"], params.max_new_tokens)  # checked before torch is imported
    draft = draft_from(kw)
    confidence = settings_from(kw)
    _check_pairs(kw, params, draft[0])
    _check_files(json_path, kw["jsonl_path"])
    text = read_prompt(prompt, prompt_file, kw["chat"])
    view, status = consoles(json_path, no_color)
    local = {"device": device, "dtype": dtype, "allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code,
             "device_map": kw.pop("device_map"), "weights": kw.pop("weights"), "compile": kw["compile_"],
             "matmul": kw.pop("matmul"), "batch_invariant": kw["batch_invariant"],
             "echo": kw["echo"], "waterfall": kw["waterfall"]}  # fmt: skip
    inside = {"lens": kw["lens"], "attention": kw["attention"]}
    if kw["server"]:
        trace = traced_remotely(kw["server"], model, local, text, params, kw["chat"], inside, status)
        if kw["jsonl_path"] is not None:
            save_lines(kw["jsonl_path"], trace)
    else:
        trace = _traced_here(status, model, local, text, params, kw, draft, confidence)
    _show(trace, kw, view, json_path, html_path, plot_path)
    kv_checked(trace)


def _check_pairs(kw: dict, params, draft: str | None) -> None:
    """The options that do not combine, refused before anything is loaded."""
    if kw["uncertainty"] and kw["server"]:
        raise InvalidParameter("--uncertainty: not with --server (the scores are computed where the model runs)")
    if params.constraint is not None:  # a schema, regex or grammar that does not compile: before anything else
        from lmtrace.logits import grammar

        grammar.check(params)
    if kw["against"] is not None and not kw["attribution"]:
        raise InvalidParameter(f"against needs --attribution, got --against {kw['against']}")
    if kw["matmul"] != "default" and kw["server"]:
        raise InvalidParameter(f"server: --matmul {kw['matmul']} is the server's own option (lmtrace serve --matmul)")
    check_compile_kernels(kw["compile_"], kw["matmul"], draft)
    check_compile_packed(kw["compile_"], kw["weights"])
    if kw["batch_invariant"] and kw["server"]:
        raise InvalidParameter("server: --batch-invariant is the server's own option (lmtrace serve --batch-invariant)")
    if kw["batch_invariant"] and kw["compile_"]:
        raise InvalidParameter("compile: --compile chooses its own kernels; not with --batch-invariant")
    if kw["server"] and kw["attribution"]:
        raise InvalidParameter("server: --attribution runs in this process only; drop --server or --attribution")


def _check_files(json_path: str | None, jsonl_path: str | None) -> None:
    """--jsonl names a file of its own; --json-indent indents the --json output (never a JSON Lines file)."""
    if jsonl_path == "-" or (jsonl_path is not None and jsonl_path == json_path):
        raise InvalidParameter(f"jsonl: a file of its own (not stdout, not the --json file), got {jsonl_path!r}")
    if jsonl_path is not None:
        check_folder("jsonl", jsonl_path)
    if json_indent() is not None and json_path is None:
        raise InvalidParameter(f"json-indent: indents the --json output; give --json FILE (got --json-indent "
                               f"{json_indent()} without it; JSON Lines are one line each)")  # fmt: skip


def _traced_here(status, model, local: dict, text: str, params, kw: dict, draft: tuple, confidence: dict) -> Trace:
    """The trace made in this process, with a progress bar."""
    announce(status, model)  # the first line on screen, before the imports
    from lmtrace.decode.options import GenerateOptions
    from lmtrace.decode.tracing import generate as run

    lm = load_model(status, model, local["device"], local["dtype"], local["allow_pickle"],
                    local["trust_remote_code"], local["device_map"], local["weights"], local["matmul"],
                    batch_invariant=local["batch_invariant"])  # fmt: skip
    spec, draft_tokens = draft
    chosen = load_draft(status, lm, spec)
    uncertainty = False
    if kw["uncertainty"]:
        from lmtrace.decode.uncertainty import Uncertainty

        uncertainty = Uncertainty(**confidence, vocab=lm.model.config.vocab_size)
    with ExitStack() as stack:
        lines = None
        if kw["jsonl_path"] is not None:  # each step's line written as the step comes
            from lmtrace.decode.tracing import encode_prompt
            from lmtrace.trace_file import TraceLines

            lines = stack.enter_context(TraceLines(kw["jsonl_path"], encode_prompt(lm, text, kw["chat"])))
        progress = stack.enter_context(progress_bar(status, params.max_new_tokens))
        task = progress.add_task("generate", total=params.max_new_tokens)

        def on_step(row: int, step) -> None:
            progress.advance(task)
            if lines is not None:
                lines.step(step)

        options = GenerateOptions(
            params,
            chat=kw["chat"],
            echo=kw["echo"],
            waterfall=kw["waterfall"],
            compile=kw["compile_"],
            lens=kw["lens"],
            attention=kw["attention"],
            draft=chosen,
            draft_tokens=draft_tokens,
            uncertainty=uncertainty,
            attribution=kw["attribution"],
            against=kw["against"],
        )
        trace = run(lm, text, on_step=on_step, options=options)
        if lines is not None:
            lines.close(trace)
    return trace


def _show(trace: Trace, kw: dict, view, json_path, html_path, plot_path) -> None:
    """The trace on screen, in the JSON file and the reports asked for."""
    from lmtrace.render.terminal.trace import print_trace

    save_trace(json_path, trace)
    print_trace(trace, view, kw["show_prompt"])
    print_extras(trace, kw["waterfall"], view)
    if "uncertainty" in trace.entries:
        from lmtrace.render.terminal.uncertainty import scores_table

        view.print(scores_table(trace.uncertainty))
    if kw["lens"]:
        from lmtrace.render.terminal.inside import settled_line

        view.print(settled_line(trace))
    if kw["attribution"]:
        from lmtrace.render.terminal.attribution import attribution_table

        view.print(attribution_table(trace, view.width))
    if json_path and json_path != "-":
        view.print(f"[dim]trace written to {json_path}[/dim]")
    if kw["jsonl_path"]:
        view.print(f"[dim]trace written to {kw['jsonl_path']} (JSON Lines)[/dim]")
    write_reports(trace, html_path, plot_path, view)


def save_trace(json_path: str | None, trace: Trace) -> None:
    """--json: the trace written step by step, compact unless --json-indent (atomically; '-': stdout)."""
    from lmtrace.trace_file import save_json, write_json

    if json_path == "-":
        write_json(sys.stdout, trace, json_indent())
    elif json_path is not None:
        save_json(json_path, trace, json_indent())


def save_lines(jsonl_path: str, trace: Trace) -> None:
    """--jsonl for a trace made elsewhere (a server's): its lines written from the trace, atomically."""
    from lmtrace.files import atomic_text
    from lmtrace.trace_file import write_lines

    with atomic_text(jsonl_path) as out:
        write_lines(out, trace)


def traced_remotely(server: str, model: str | None, local: dict, text: str, params, chat: bool, inside: dict,
                    status) -> Trace:  # fmt: skip
    """The trace made by a live `lmtrace serve` (no torch here), with the same progress bar."""
    base = remote.check(server, model, local)
    with progress_bar(status, params.max_new_tokens) as progress:
        task = progress.add_task("generate", total=params.max_new_tokens)
        found = remote.trace(base, model, text, params, chat, inside, lambda step: progress.advance(task))
    return Trace.from_dict(found)
