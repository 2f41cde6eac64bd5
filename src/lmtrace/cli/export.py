"""`lmtrace export --model M OUT_DIR`: the exact weights lmtrace traces, as a safetensors folder
(config, tokenizer, weights) that transformers, lm-eval's `hf` backend or vLLM load."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from lmtrace.cli.common import cli, load_model
from lmtrace.cli.options import model_options


@cli.command("export")
@click.argument("out_dir", metavar="OUT_DIR")
@model_options
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def export_command(out_dir, model, device, dtype, allow_pickle, trust_remote_code, no_color):
    """Write the model (default: the bundled one; a .gguf is dequantized) to OUT_DIR, a new or
    empty folder, as config.json, model.safetensors and the tokenizer: transformers loads it
    back to the same logits. --dtype auto means float32 here, the GGUF's weights exactly."""
    from lmtrace.model.folder import check_out_dir, save_folder

    check_out_dir(Path(out_dir).expanduser())  # a bad OUT_DIR fails before the model loads
    status = Console(stderr=True, no_color=no_color, highlight=False)
    lm = load_model(status, model, device, "float32" if dtype == "auto" else dtype, allow_pickle, trust_remote_code)
    with status.status(f"Writing {out_dir}…"):
        out = save_folder(lm, out_dir)
    size = sum(p.stat().st_size for p in out.iterdir())
    click.echo(f"wrote {out} ({size / 1e6:.1f} MB: {', '.join(sorted(p.name for p in out.iterdir()))})")
    click.echo(f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}), or: lmtrace generate --model {out} …")
