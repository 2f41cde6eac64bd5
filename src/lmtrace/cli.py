"""The command line: parse, call the library, render. Errors become one line and an exit code
(0 done, 2 bad input, 1 a failure while running)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lmtrace.errors import InvalidParameter, LmtraceError
from lmtrace.params import SamplingParams

model_options = [
    click.option(
        "--model",
        "model",
        default=None,
        metavar="PATH|ID",
        help="Model folder, .gguf file or hub id (local cache). Default: the bundled SmolLM2-135M-Instruct.",
    ),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or mps."),
    click.option(
        "--dtype",
        default="auto",
        show_default=True,
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16 or bfloat16.",
    ),
    click.option("--allow-pickle", is_flag=True, help="Allow .bin/.pt pickle weights (they can run code)."),
    click.option("--trust-remote-code", is_flag=True, help="Run the model repository's own Python code."),
]


def with_model_options(f):
    for option in reversed(model_options):
        f = option(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lmtrace")
def cli() -> None:
    """See inside a language model's decoding: every token's probability, rank, alternatives,
    entropy, and the KV cache."""


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise InvalidParameter("prompt: give PROMPT or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidParameter(f"prompt-file: cannot read {prompt_file!r} ({e.strerror})") from e
    if prompt is not None:
        return prompt
    if sys.stdin is not None and not sys.stdin.isatty():
        return sys.stdin.read()
    raise InvalidParameter("prompt: none given (pass PROMPT, --prompt-file FILE, or pipe it on standard input)")


def load_model(
    console: Console, model: str | None, device: str, dtype: str, allow_pickle: bool, trust_remote_code: bool
):
    from transformers.utils import logging as hf_logging

    from lmtrace.loading import load

    hf_logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader uses a plain tqdm bar
    hf_logging.set_verbosity_error()
    with console.status(f"Loading {model or 'the bundled SmolLM2-135M-Instruct'}…"):
        return load(model, device=device, dtype=dtype, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=str, default=None, help="Read the prompt from this file.")
@with_model_options
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 means greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1: off).")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="Drop tokens below min_p × the top one.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="1: off.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (recorded in the trace).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the text is cut before it.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the chat template.")
@click.option("--top-logprobs", type=int, default=5, show_default=True, help="Alternatives recorded per step (0-100).")
@click.option("--json", "json_path", default=None, metavar="FILE", help="Write the trace as JSON ('-' for stdout).")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def generate(
    prompt,
    prompt_file,
    model,
    device,
    dtype,
    allow_pickle,
    trust_remote_code,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    min_p,
    repetition_penalty,
    seed,
    stop,
    chat,
    top_logprobs,
    json_path,
    no_color,
) -> None:
    """Generate from PROMPT and show every token's probability, rank, entropy and alternatives."""
    from lmtrace.files import write_atomic
    from lmtrace.render.terminal import print_trace
    from lmtrace.tracing import generate as run

    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=tuple(stop),
        top_logprobs=top_logprobs,
    )
    text = read_prompt(prompt, prompt_file)
    to_stdout = json_path == "-"
    view = Console(stderr=to_stdout, no_color=no_color, highlight=False)
    status = Console(stderr=True, no_color=no_color)
    lm = load_model(status, model, device, dtype, allow_pickle, trust_remote_code)
    columns = [TextColumn("Generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=status, transient=True) as progress:
        task = progress.add_task("generate", total=params.max_new_tokens)
        trace = run(lm, text, params, chat=chat, on_step=lambda row, step: progress.advance(task))
    if json_path is not None:
        if to_stdout:
            click.echo(trace.to_json(indent=2))
        else:
            write_atomic(json_path, trace.to_json(indent=2) + "\n")
    print_trace(trace, view)
    if json_path and not to_stdout:
        view.print(f"[dim]trace written to {json_path}[/dim]")


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="lmtrace", standalone_mode=False)
        return 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("lmtrace: aborted", err=True)
        return 130
    except click.ClickException as e:
        click.echo(f"lmtrace: error: {' '.join(e.format_message().split())}", err=True)
        return 2
    except LmtraceError as e:
        click.echo(f"lmtrace: error: {e}", err=True)
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("lmtrace: interrupted", err=True)
        return 130
    except Exception as e:  # a failure while running: one line, the traceback only on request
        if os.environ.get("LMTRACE_DEBUG"):
            raise
        click.echo(f"lmtrace: error: {type(e).__name__}: {' '.join(str(e).split())}", err=True)
        return 1


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
