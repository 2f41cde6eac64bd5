"""`lmtrace verify`: the cached loop against a recompute without cache and model.generate."""

from __future__ import annotations

import json

import click
from rich.table import Table
from rich.text import Text

from lmtrace.cli.common import announce, cli, consoles, load_model, read_prompt, write_json
from lmtrace.cli.options import json_indent, json_option, model_options, weights_option
from lmtrace.errors import InvalidParameter


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=str, default=None, help="Read the prompt from this file.")
@model_options
@weights_option
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Greedy steps to check.")
@click.option("--tolerance", type=float, default=None,
              help="Largest log-probability difference (default 1e-4 in float32, 0.5 with packed weights, "
                   "0.1 in 16-bit dtypes).")  # fmt: skip
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the chat template.")
@click.option("--rescore", is_flag=True,
              help="Also trace a generation and rescore it teacher-forced against the recorded logprobs.")  # fmt: skip
@json_option("the report")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def verify(prompt, prompt_file, model, device, dtype, allow_pickle, trust_remote_code, weights, max_new_tokens,
           tolerance, chat, rescore, json_path, no_color):  # fmt: skip
    """Decode PROMPT greedily with the KV cache and check every step against a full recompute
    without cache and against model.generate. Exit code 0 when they agree, 1 otherwise."""
    import math

    if max_new_tokens < 1:  # argument errors before torch is imported
        raise InvalidParameter(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if tolerance is not None and (not math.isfinite(tolerance) or tolerance < 0):
        raise InvalidParameter(f"tolerance must be a finite number >= 0, got {tolerance}")
    text = read_prompt(prompt, prompt_file, chat)
    view, status = consoles(json_path, no_color)
    announce(status, model)
    from lmtrace.decode.tracing import encode_prompt
    from lmtrace.scoring.teacher.verify import verify as run

    lm = load_model(status, model, device, dtype, allow_pickle, trust_remote_code, weights=weights)
    ids = encode_prompt(lm, text, chat)
    with status.status("Decoding, recomputing without cache, and running model.generate…"):
        report = run(lm, ids, max_new_tokens, tolerance)
    result = report.to_dict()
    ok = report.ok
    if rescore:
        round_trip = rescore_trace(lm, text, chat, max_new_tokens)
        result["rescore"] = round_trip
        ok = ok and round_trip["max_abs_diff"] <= report.tolerance
        view.print(f"rescore: {round_trip['steps']} recorded logprobs against a teacher-forced pass: largest "
                   f"difference {round_trip['max_abs_diff']:.2e} at step {round_trip['worst_step']}")  # fmt: skip
    write_json(json_path, json.dumps(result, indent=json_indent()))
    view.print(report_view(report, lm.tokenizer))
    if not ok:
        raise click.exceptions.Exit(1)


def rescore_trace(lm, text: str, chat: bool, max_new_tokens: int) -> dict:
    """The round trip: a traced greedy generation, rescored teacher-forced (lmtrace.rescore)."""
    from lmtrace.decode.tracing import generate
    from lmtrace.scoring.teacher.rescore import rescore

    trace = generate(lm, text, chat=chat, max_new_tokens=max_new_tokens, temperature=0)
    found = rescore(lm, trace)
    return {k: v for k, v in found.items() if k not in ("logprobs", "sampled_logprobs")}


def report_view(report, tokenizer) -> Table | Text:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("step", "token", "max |Δlogit| no-cache", "max |Δlogprob| no-cache", "top-1", "generate",
                 "max |Δlogprob| generate", "top1−top2"):  # fmt: skip
        table.add_column(name, justify="right")
    for s in report.steps:
        same = s.generate_token_id == s.token_id
        gen_diff = "" if s.generate_logprob_diff is None else f"{s.generate_logprob_diff:.2e}"
        top1 = "agree" if s.top1_agrees else Text("DIFFER", style="red")
        gen = "same" if same else Text(str(s.generate_token_id), style="red")
        table.add_row(str(s.index), repr(tokenizer.decode([s.token_id])), f"{s.max_logit_diff:.2e}",
                      f"{s.max_logprob_diff:.2e}", top1, gen, gen_diff, f"{s.margin:.3f}")  # fmt: skip
    verdict = Text()
    if report.float32_max_logprob_diff is not None:
        what = f"{report.packed} weights" if report.weights == "packed" else report.dtype
        verdict.append(f"{what} against float32 weights: largest log-probability difference "
                       f"{report.float32_max_logprob_diff:.3g}, mean over the chosen tokens "
                       f"{report.float32_mean_logprob_diff:.3g}, top-1 agreement "
                       f"{report.float32_top1_agreement:.0%}\n")  # fmt: skip
    if report.ok:
        verdict.append(f"OK: {len(report.steps)} steps agree; largest log-probability difference "
                       f"{report.max_logprob_diff:.2e} ≤ {report.tolerance:g}", style="bold green")  # fmt: skip
    else:
        d = report.first_divergence
        verdict.append("FAIL: ", style="bold red")
        if d:
            verdict.append(f"first divergence at step {d['step']}: {d['reason']}")
            if "margin" in d:
                verdict.append(f" (top-1/top-2 margin {d['margin']:.4f})")
        else:
            verdict.append(f"largest log-probability difference {report.max_logprob_diff:.2e} > {report.tolerance:g}")
    from rich.console import Group

    return Group(table, Text(), verdict)
