"""`lmtrace compare`: another engine's logprobs against the model's own."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Group
from rich.table import Table
from rich.text import Text

from lmtrace.cli.common import cli, consoles, load_model, write_json
from lmtrace.cli.options import json_indent, json_option, model_options
from lmtrace.errors import InvalidParameter
from lmtrace.render.tokens import escape


def read_json(path: str, parameter: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidParameter(f"{parameter}: cannot read {path!r} ({e.strerror})") from e
    except ValueError as e:
        raise InvalidParameter(f"{parameter}: {path!r} is not valid JSON ({e})") from e


@cli.command()
@click.argument("response_file", metavar="RESPONSE.json")
@model_options
@click.option("--prompt", default=None, help="The prompt, when the file does not hold it.")
@click.option("--messages", "messages_file", default=None, metavar="FILE", help="Chat messages (JSON list).")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="The engine's sampling temperature.")
@click.option("--top-k", type=int, default=0, show_default=True, help="The engine's top-k (0: off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="The engine's top-p (1: off).")
@click.option("--threshold", type=float, default=0.1, show_default=True, help="A large difference, in nats.")
@json_option("the comparison")
@click.option("--html", "html_path", default=None, metavar="FILE", help="Write the text coloured by difference.")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def compare(response_file, model, device, dtype, allow_pickle, trust_remote_code, prompt, messages_file, temperature,
            top_k, top_p, threshold, json_path, html_path, no_color):  # fmt: skip
    """Compare the logprobs another engine reported (OpenAI completions or chat, llama.cpp, an
    lmtrace trace) with the model's own, token by token."""
    from lmtrace.comparison import compare as run
    from lmtrace.comparison import parse_response
    from lmtrace.params import SamplingParams

    SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # validates, naming the parameter
    rep = parse_response(read_json(response_file, "response"))
    if prompt is not None:
        rep.prompt, rep.prompt_ids = prompt, None
    if messages_file is not None:
        rep.messages = read_json(messages_file, "messages")
    view, status = consoles(json_path, no_color)
    lm = load_model(status, model, device, dtype, allow_pickle, trust_remote_code)
    with status.status("Rescoring teacher-forced…"):
        result = run(lm, rep, temperature=temperature, top_k=top_k, top_p=top_p, threshold=threshold)
    write_json(json_path, json.dumps(result.to_dict(), indent=json_indent()))
    if html_path is not None:
        from lmtrace.render.html.compare import write_compare_html

        write_compare_html(html_path, result.to_dict(), lm.source)
    view.print(comparison_view(result.to_dict()))


def comparison_view(d: dict) -> Group:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("#", "token", "engine", "model raw", "processed", "diff", "KL top", "top-1", "rank"):
        table.add_column(name, justify="right")
    for r in d["tokens"]:
        big = r["diff"] is not None and abs(r["diff"]) > d["summary"]["threshold"]
        top1 = "yes" if r["engine_top1"] else Text("no", style="yellow")
        table.add_row(str(r["index"]), escape(r["token"]), _f(r["engine_logprob"]), _f(r["model_logprob"]),
                      _f(r["model_processed_logprob"]), Text(_f(r["diff"]), style="red" if big else ""),
                      _f(r["kl_top"]), top1, str(r["model_rank"]))  # fmt: skip
    s = d["summary"]
    out = Text()
    out.append(f"{d['kind']}: {s['compared']} tokens compared", style="bold")
    if d["unmapped"]:
        u = d["unmapped"][0]
        out.append(f"; stopped at token {u['index']} {u['token']!r}: no token of this tokenizer has its bytes",
                   style="yellow")  # fmt: skip
    out.append(f"\ntop-1 agreement {_pct(s['top1_agreement'])}, mean |diff| {_f(s['mean_abs_diff'])} nats, "
               f"max {_f(s['max_abs_diff'])}, above {s['threshold']:g}: {_pct(s['frac_above_threshold'])}, "
               f"first large divergence: {s['first_large_divergence']}\n")  # fmt: skip
    out.append(f"verdict: {s['verdict']}", style="bold green" if s["verdict"] == "raw" else "bold yellow")
    out.append(f" — {s['reason']}")
    return Group(table, Text(), out)


def _f(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"
