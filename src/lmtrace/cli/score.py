"""`lmtrace score`: how likely a given text is under the model, token by token (teacher forcing);
`--file TEXTS.jsonl` scores a list ({"text": ...} per line) in padded batches into one JSON list,
`--jsonl IN OUT` one record per line into a JSON-lines file."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lmtrace.cli import remote
from lmtrace.cli.common import announce, cli, consoles, load_model, read_text
from lmtrace.cli.options import batch_invariant_option, device_map_option, json_indent, json_option, model_options
from lmtrace.cli.remote import server_option
from lmtrace.cli.reports import check_report_paths, report_options, write_reports
from lmtrace.errors import InvalidParameter
from lmtrace.files import write_atomic
from lmtrace.params import MAX_TOP_LOGPROBS, check_integer


def _text(text: str | None, file: str | None, prompt: str | None, continuation: str | None) -> str | None:
    """The text to score, or None when --prompt/--continuation give it."""
    if prompt is not None or continuation is not None:
        if text is not None or file is not None:
            raise InvalidParameter("text: give TEXT (or --file), or --prompt with --continuation, not both")
        if prompt is None or continuation is None:
            missing = "--prompt" if prompt is None else "--continuation"
            raise InvalidParameter(f"{missing}: none given (--prompt and --continuation go together)")
        return None
    return read_text(text, file, "text", "file", "pass TEXT, --file, --prompt with --continuation, or standard input",
                     allow_empty=False)  # fmt: skip


def _check(options: dict) -> None:
    """The checks that need no model, before it loads (window's upper bound needs the model)."""
    check_integer("top_logprobs", options["top_logprobs"], low=0, high=MAX_TOP_LOGPROBS)
    check_integer("batch_size", options["batch_size"], low=1)
    if options["window"] is not None:
        check_integer("window", options["window"], low=2)
    if options["stride"] is not None:
        check_integer("stride", options["stride"], low=1)


def read_jsonl(path: str, name: str = "jsonl") -> list[tuple[object, str | tuple[str, str]]]:
    """[(id, text or (prompt, continuation))], every line checked before the model loads;
    `name` is the option that messages name."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InvalidParameter(f"{name}: cannot read {path!r} ({e.strerror})") from e
    records = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidParameter(f"{name}: line {n} of {path} is not JSON ({e.msg})") from e
        if not isinstance(d, dict):
            raise InvalidParameter(f"{name}: line {n} of {path} must be an object, got {type(d).__name__}")
        key = d.get("id", n)
        if isinstance(d.get("text"), str) and "prompt" not in d and "continuation" not in d:
            records.append((key, d["text"]))
        elif isinstance(d.get("prompt"), str) and isinstance(d.get("continuation"), str) and "text" not in d:
            records.append((key, (d["prompt"], d["continuation"])))
        else:
            raise InvalidParameter(
                f"{name}: line {n} of {path} needs a string 'text', or strings 'prompt' and 'continuation'"
            )
    if not records:
        raise InvalidParameter(f"{name}: no records in {path}")
    return records


def _progress(console, total: int) -> Progress:
    columns = [TextColumn("Scoring"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    return Progress(*columns, console=console, transient=True)


def _scored(lm, records, status, options) -> list:
    """[(id, ScoreResult)] of every record, batched, with a progress bar."""
    from lmtrace.scoring.teacher.score import score_batch

    with _progress(status, len(records)) as progress:
        task = progress.add_task("score", total=len(records))
        results = score_batch(
            lm, [item for _, item in records], on_result=lambda i, r: progress.advance(task), **options
        )
    return [(key, r) for (key, _), r in zip(records, results)]


def _score_list(lm, records, json_path: str | None, view, status, **options) -> None:
    """--file TEXTS.jsonl: the results as one JSON list, each with its record's id."""
    from lmtrace.cli.common import write_json
    from lmtrace.render.terminal.score import summary_table

    keyed = _scored(lm, records, status, options)
    scores = [{"id": key, **r.to_dict()} for key, r in keyed]
    write_json(json_path, json.dumps(scores, ensure_ascii=False, indent=json_indent()))
    view.print(summary_table(keyed))
    if len(records) > 20:
        view.print(f"[dim]… and {len(records) - 20} more[/dim]")
    if json_path and json_path != "-":
        view.print(f"[dim]{len(records)} scores written to {json_path}[/dim]")


def _score_jsonl(lm, records, out_path: str, view, status, **options) -> None:
    from lmtrace.render.terminal.score import summary_table

    keyed = _scored(lm, records, status, options)
    lines = [json.dumps({"id": key, **r.to_dict()}, ensure_ascii=False, allow_nan=False) for key, r in keyed]
    if out_path == "-":
        click.echo("\n".join(lines))
    else:
        write_atomic(out_path, "\n".join(lines) + "\n")
    view.print(summary_table(keyed))
    if len(records) > 20:
        view.print(f"[dim]… and {len(records) - 20} more[/dim]")
    if out_path != "-":
        view.print(f"[dim]{len(records)} scores written to {out_path}[/dim]")


@cli.command()
@click.argument("text", required=False)
@click.option(
    "--file",
    "file",
    default=None,
    help="Read the text to score from this file; a .jsonl file is a list to score ({\"text\": ...} per line), batched.",
)
@click.option("--prompt", default=None, help="Condition on this prompt and score only --continuation.")
@click.option("--continuation", default=None, help="The text scored after --prompt.")
@click.option(
    "--jsonl",
    nargs=2,
    default=None,
    metavar="IN OUT",
    help="Score each line of IN ({id, text} or {id, prompt, continuation}); one result per line to OUT.",
)
@click.option("--window", type=int, default=None, help="Tokens per forward pass. Default: the model's context.")
@click.option("--stride", type=int, default=None, help="Tokens between sliding windows. Default: window / 2.")
@click.option(
    "--batch-size", type=int, default=8, show_default=True, help="Records per forward pass (a .jsonl --file, --jsonl)."
)
@click.option("--top-logprobs", type=int, default=5, show_default=True, help="Alternatives per token (0-100).")
@model_options
@batch_invariant_option
@device_map_option
@json_option("the scores")
@report_options
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
@server_option
def score(text, file, prompt, continuation, jsonl, json_path, html_path, plot_path, no_color, server, **options):
    """Score TEXT teacher-forced: every token's probability, rank, entropy and alternatives,
    the total logprob, perplexity and bits per byte."""
    from lmtrace.cli.common import write_json

    keys = ("model", "device", "dtype", "allow_pickle", "trust_remote_code", "device_map")
    loading = [options.pop(k) for k in keys]
    invariant = options.pop("batch_invariant")
    _check(options)
    if server and invariant:
        raise InvalidParameter("server: --batch-invariant is the server's own option (lmtrace serve --batch-invariant)")
    if server:
        _remotely(server, loading, text, file, prompt, continuation, jsonl, json_path, html_path, plot_path,
                  no_color, options)  # fmt: skip
        return
    if jsonl:
        if any(x is not None for x in (text, file, prompt, continuation, json_path)):
            raise InvalidParameter("jsonl: --jsonl IN OUT reads IN and writes OUT; drop TEXT, --file, --prompt, --json")
        records = read_jsonl(jsonl[0])
        view, status = consoles(jsonl[1], no_color)
        announce(status, loading[0])
        lm = load_model(status, *loading, batch_invariant=invariant)
        _score_jsonl(lm, records, jsonl[1], view, status, **options)
        return
    if file is not None and file.endswith(".jsonl"):
        if any(x is not None for x in (text, prompt, continuation, html_path, plot_path)):
            raise InvalidParameter("file: a .jsonl list is scored into --json; drop TEXT, --prompt, --html, --plot")
        records = read_jsonl(file, "file")
        view, status = consoles(json_path, no_color)
        lm = load_model(status, *loading, batch_invariant=invariant)
        _score_list(lm, records, json_path, view, status, **options)
        return
    source = _text(text, file, prompt, continuation)
    check_report_paths(html_path, plot_path)
    view, status = consoles(json_path, no_color)
    announce(status, loading[0])
    from lmtrace.render.terminal.score import print_score
    from lmtrace.scoring.teacher.score import score as run

    lm = load_model(status, *loading, batch_invariant=invariant)
    kwargs = {k: options[k] for k in ("window", "stride", "top_logprobs")}
    with status.status("Scoring…"):
        result = run(lm, source, prompt=prompt, continuation=continuation, **kwargs)
    write_json(json_path, result.to_json(indent=json_indent()))
    print_score(result, view)
    write_reports(result, html_path, plot_path, view)
    if json_path and json_path != "-":
        view.print(f"[dim]scores written to {json_path}[/dim]")


def _remotely(server, loading, text, file, prompt, continuation, jsonl, json_path, html_path, plot_path, no_color,
              options) -> None:  # fmt: skip
    """The scoring done by a live `lmtrace serve`; the answer shown and written as a local one."""
    from lmtrace.cli.common import write_json
    from lmtrace.render.terminal.score import print_score

    keys = ("device", "dtype", "allow_pickle", "trust_remote_code", "device_map")
    base = remote.check(server, loading[0], {**dict(zip(keys, loading[1:])), "jsonl": jsonl})
    source = _text(text, file, prompt, continuation)
    check_report_paths(html_path, plot_path)
    view, status = consoles(json_path, no_color)
    fields = {"text": source, "prompt": prompt, "continuation": continuation, **{k: options[k] for k in
              ("window", "stride", "top_logprobs")}}  # fmt: skip
    with status.status("Scoring on the server…"):
        result = remote.score(base, loading[0], fields)
    write_json(json_path, result.to_json(indent=json_indent()))
    print_score(result, view)
    write_reports(result, html_path, plot_path, view)
