"""`lmtrace kld`: quantization over a corpus. Model A and model B (another file, the same GGUF's
packed weights, another dtype) side by side over a text, chunk by chunk, with the statistics
`llama-perplexity --kl-divergence` prints and the worst positions."""

from __future__ import annotations

import json

import click

from lmtrace.cli.common import cli, consoles, load_model, read_text, write_json
from lmtrace.cli.options import json_indent, json_option, model_options
from lmtrace.cli.reports import check_report_paths
from lmtrace.errors import InvalidParameter


@cli.command("kld")
@click.option("--against", required=True, metavar="B",
              help="Model B: packed (the same GGUF's own quantized weights), dtype:bfloat16 / dtype:float16 "
                   "(A's weights cast), or the path of another model file or folder (the same tokenizer).")  # fmt: skip
@click.option("--file", "file_path", required=True, metavar="TEXT", help="The corpus: a UTF-8 text file.")
@click.option("--ctx", type=int, default=512, show_default=True,
              help="Tokens per chunk (llama.cpp's -c); the second half of each chunk is scored.")  # fmt: skip
@click.option("--chunks", type=int, default=None, help="Score at most this many chunks (llama.cpp's --chunks).")
@click.option("--worst", type=int, default=10, show_default=True, help="Positions of largest KL to show.")
@model_options
@json_option("the statistics")
@click.option("--html", "html_path", default=None, metavar="FILE", help="Write a self-contained HTML report.")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def kld_command(against, file_path, ctx, chunks, worst, model, device, dtype, allow_pickle, trust_remote_code,
                json_path, html_path, no_color, **_):  # fmt: skip
    """How far model B is from model A over a corpus: perplexity of each and their ratio, the
    KL divergence KL(A‖B) per position (mean, median, 99%, 99.9%, max), the percentiles of
    Δp = p_B − p_A for the text's next token and the share of positions with the same top token,
    as `llama-perplexity --kl-divergence` computes them, with both models side by side (no
    base-logits file)."""
    if ctx < 4:
        raise InvalidParameter(f"ctx must be >= 4, got {ctx}")
    if chunks is not None and chunks < 1:
        raise InvalidParameter(f"chunks must be >= 1, got {chunks}")
    if worst < 0:
        raise InvalidParameter(f"worst must be >= 0, got {worst}")
    if not against.strip():
        raise InvalidParameter("against: give packed, dtype:NAME or a model path")
    text = read_text(None, file_path, "file", "file", "give --file TEXT", allow_empty=False)
    check_report_paths(html_path, None)
    view, status = consoles(json_path, no_color)
    lm = load_model(status, model, device, dtype, allow_pickle, trust_remote_code)

    from lmtrace.render.html import kld as kld_html
    from lmtrace.render.terminal import kld as render
    from lmtrace.scoring.kld import against_model, kld

    with status.status(f"Loading B ({against})…") as spinner:
        other = against_model(lm, against)
        result = kld(lm, other, text, ctx=ctx, chunks=chunks, worst=worst,
                     on_chunk=lambda i, n: spinner.update(f"Scoring chunk {i}/{n}…"))  # fmt: skip
    write_json(json_path, json.dumps(result, indent=json_indent(), ensure_ascii=False))
    view.print(render.terminal(result))
    if html_path is not None:
        kld_html.write_html(result, html_path)
        view.print(f"HTML report: {html_path}", markup=False, highlight=False)
