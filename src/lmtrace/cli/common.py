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

from lmtrace import arguments
from lmtrace.errors import InvalidParameter
from lmtrace.files import write_atomic

_clock = [time.perf_counter(), 0]  # [the command's start ("ready in" counts from it), commands begun]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lmtrace")
def cli() -> None:
    """See inside a language model's decoding: every token's probability, rank, alternatives,
    entropy, and the KV cache."""


def read_text(value: str | None, path: str | None, name: str, file_option: str, none_given: str,
              allow_empty: bool = True) -> str:  # fmt: skip
    """A text argument, or the file named by its option, or standard input when piped; the
    errors name `name` / `file_option` (e.g. "prompt" / "prompt-file"), before torch is imported."""
    if value is not None and path is not None:
        raise InvalidParameter(f"{name}: give {name.upper()} or --{file_option}, not both")
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidParameter(f"{file_option}: cannot read {path!r} ({e.strerror})") from e
        except UnicodeDecodeError as e:
            raise InvalidParameter(f"{file_option}: {path!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                                   f"offset {e.start})") from e  # fmt: skip
        where = f"--{file_option} {path!r}"
    elif value is not None:
        text, where = value, name.upper()
    elif sys.stdin is not None and not sys.stdin.isatty():
        text, where = sys.stdin.read(), "standard input"
    else:
        raise InvalidParameter(f"{name}: none given ({none_given})")
    if not text and not allow_empty:
        raise InvalidParameter(f"{name}: {where} is empty; give some text (a model needs at least one token)")
    return text


def read_prompt(prompt: str | None, prompt_file: str | None, chat: bool = False) -> str:
    """The prompt; empty only with --chat (the template's own tokens are then the prompt)."""
    return read_text(prompt, prompt_file, "prompt", "prompt-file",
                     "pass PROMPT, --prompt-file FILE, or pipe it on standard input", allow_empty=chat)  # fmt: skip


class Startup:
    """The first line on screen, printed before torch is imported (the imports take seconds): the
    model by its name, then one line with the real times once it is ready."""

    def __init__(self, console: Console, model: str | None):
        self.console, self.name = console, arguments.model_source(model)
        self.spinner = None
        if console.is_terminal:  # a spinner that turns while torch and transformers are imported
            self.spinner = console.status(f"{self.name}: importing torch and transformers…")
            self.spinner.start()
        else:
            console.print(f"{self.name}: loading (importing torch and transformers)…", markup=False,
                          highlight=False, soft_wrap=True, style="dim")  # fmt: skip

    def update(self, text: str) -> None:
        if self.spinner is not None:
            self.spinner.update(text)

    def ready(self, lm: Any, said: list[str]) -> None:
        """Stops the spinner; the line with the times, the load's own lines with --verbose."""
        if self.spinner is not None:
            self.spinner.stop()
        total = time.perf_counter() - _clock[0]
        weights = lm.load_timing.get("weights_s", 0.0)
        line = f"{self.name} ready in {total:.1f} s: imports {total - weights:.1f} s, weights {weights:.1f} s"
        if any("converted to safetensors in" in x for x in said):
            line += " (converted to safetensors once; later runs load the copy)"
        shown = said if verbose() else [x for x in said if x.startswith("Cannot keep")]
        for x in shown:
            self.console.print(x, markup=False, highlight=False, soft_wrap=True, style="dim")
        self.console.print(line, markup=False, highlight=False, soft_wrap=True, style="dim")


_started: list[Startup] = []  # the command's Startup, once announced


def begin() -> None:
    """A command starts: the first one in a process counts from the import of the command line."""
    if _clock[1]:
        _clock[0] = time.perf_counter()
    _clock[1] += 1


def finish() -> None:
    """A command ended (perhaps with an error before its model loaded): no spinner is left turning."""
    while _started:
        spinner = _started.pop().spinner
        if spinner is not None:
            spinner.stop()


def announce(console: Console, model: str | None) -> None:
    """Says at once which model is being loaded, before the command imports torch; a bad --model
    is answered here."""
    if not _started:
        _started.append(Startup(console, model))


def verbose() -> bool:
    """--verbose on the running command (options.py keeps it in the click context)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get("lmtrace.verbose"))


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
    matmul: str = "default",
    batch_invariant: bool = False,
):
    """lmtrace.load after the startup line (`announce`), with a spinner on `console` (stderr)
    instead of transformers' progress bars, then one line with the real times; with packed
    weights, one more line says what runs packed and what stays float."""
    announce(console, model)
    startup = _started.pop()
    from transformers.utils import logging as hf_logging

    from lmtrace.model.load import load

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    said: list[str] = []
    startup.update(f"{startup.name}: reading the weights…")

    def status(text: str) -> None:
        said.append(text)
        startup.update(text)

    try:
        with no_gguf_bar():
            lm = load(model, device=device, dtype=dtype, allow_pickle=allow_pickle,
                      trust_remote_code=trust_remote_code, device_map=device_map, status=status,
                      weights=weights, matmul=matmul, batch_invariant=batch_invariant)  # fmt: skip
    except BaseException:
        if startup.spinner is not None:
            startup.spinner.stop()
        raise
    startup.ready(lm, said)
    if weights == "packed":
        from lmtrace.model.gguf.packed import report_of

        console.print(report_of(lm.model).line(), markup=False, highlight=False, soft_wrap=True, style="dim")
    if lm.summary.matmul is not None:
        console.print(f"matmul: {lm.summary.matmul} on oneDNN, weights packed once (float32, rounding apart "
                      "from torch's own kernel)", markup=False, highlight=False, soft_wrap=True, style="dim")
    if lm.summary.batch_invariant:
        console.print("batch-invariant: every number a row gets is the same bits alone or in any batch "
                      "(oneDNN products, fixed-chunk attention)", markup=False, highlight=False, soft_wrap=True,
                      style="dim")  # fmt: skip
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
