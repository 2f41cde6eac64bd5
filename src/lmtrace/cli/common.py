"""What the commands share: the group, prompt input, loading with a spinner, and writing JSON
(atomically, or to stdout with '-'). The options themselves are declared in options.py."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from lmtrace.errors import InvalidParameter
from lmtrace.files import write_atomic


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lmtrace")
def cli() -> None:
    """See inside a language model's decoding: every token's probability, rank, alternatives,
    entropy, and the KV cache."""


def read_text(value: str | None, path: str | None, name: str, file_option: str, none_given: str) -> str:
    """A text argument, or the file named by its option, or standard input when piped; the
    errors name `name` / `file_option` (e.g. "prompt" / "prompt-file")."""
    if value is not None and path is not None:
        raise InvalidParameter(f"{name}: give {name.upper()} or --{file_option}, not both")
    if path is not None:
        try:
            return Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidParameter(f"{file_option}: cannot read {path!r} ({e.strerror})") from e
    if value is not None:
        return value
    if sys.stdin is not None and not sys.stdin.isatty():
        return sys.stdin.read()
    raise InvalidParameter(f"{name}: none given ({none_given})")


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    return read_text(prompt, prompt_file, "prompt", "prompt-file",
                     "pass PROMPT, --prompt-file FILE, or pipe it on standard input")  # fmt: skip


@contextmanager
def no_gguf_bar() -> Iterator[None]:
    """transformers' GGUF loader draws a plain tqdm bar; the CLI says what a load does in one
    status line instead (lmtrace.load keeps it quiet too; kept for callers of this name)."""
    from lmtrace.model.gguf.quiet import quiet_gguf

    with quiet_gguf():
        yield


def load_model(
    console: Console,
    model: str | None,
    device: str,
    dtype: str,
    allow_pickle: bool,
    trust_remote_code: bool,
    device_map: str | None = None,
    weights: str = "float",
):
    """lmtrace.load with a spinner on `console` (stderr) instead of transformers' progress bars;
    a GGUF load ends with one line saying whether it converted the file or used its converted copy;
    with packed weights, one more line says what runs packed and what stays float."""
    from transformers.utils import logging as hf_logging

    from lmtrace.model.load import load

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    said: list[str] = []
    started = time.perf_counter()
    with no_gguf_bar(), console.status(f"Loading {model or 'the bundled SmolLM2-135M-Instruct'}…") as spinner:

        def status(text: str) -> None:
            said.append(text)
            spinner.update(text)

        lm = load(
            model,
            device=device,
            dtype=dtype,
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
            device_map=device_map,
            status=status,
            weights=weights,
        )
    if said:
        line = f"{said[-1]}; loaded in {time.perf_counter() - started:.1f} s"
        console.print(line, markup=False, highlight=False, soft_wrap=True, style="dim")
    if weights == "packed":
        from lmtrace.model.gguf.packed import report_of

        console.print(report_of(lm.model).line(), markup=False, highlight=False, soft_wrap=True, style="dim")
    return lm


def consoles(json_path: str | None, no_color: bool) -> tuple[Console, Console]:
    """(view, status): the view goes to stderr when JSON goes to stdout; status always to stderr."""
    view = Console(stderr=json_path == "-", no_color=no_color, highlight=False)
    return view, Console(stderr=True, no_color=no_color)


def write_json(json_path: str | None, text: str) -> None:
    if json_path is None:
        return
    if json_path == "-":
        click.echo(text)
    else:
        write_atomic(json_path, text + "\n")


def load_draft(console: Console, lm: Any, spec: str | None) -> Any:
    """The draft model for --draft (a lmtrace.model.draft.Draft; None without one), loaded with a
    spinner and one line."""
    if spec is None:
        return None
    from lmtrace.model.draft import draft_for

    started = time.perf_counter()
    with console.status(f"Loading the draft {spec}…"):
        draft = draft_for(lm, spec)
    seconds = time.perf_counter() - started
    line = f"draft {spec}: {draft.layers} layers, {draft.weights} weights; loaded in {seconds:.1f} s"
    console.print(line, markup=False, highlight=False, soft_wrap=True, style="dim")
    return draft
