"""`--html FILE` and `--plot FILE.png` for any command that produces a trace, a score result
or branches: add `@report_options`, call `check_report_paths(html, plot)` before the model
loads (bad paths fail fast, exit 2), then `write_reports(result, html, plot, console)`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from lmtrace.errors import InvalidParameter


def report_options(f):
    """Adds --html FILE and --plot FILE.png."""
    f = click.option(
        "--plot",
        "plot_path",
        default=None,
        metavar="FILE.png",
        help="Write a PNG plot: probability, entropy, KV bytes.",
    )(f)
    return click.option(
        "--html", "html_path", default=None, metavar="FILE", help="Write a self-contained HTML report."
    )(f)


def check_folder(parameter: str, path: str) -> None:
    """Fails before any work when `path` could not be written: its folder missing, or a folder itself."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise InvalidParameter(f"{parameter}: no such folder {str(folder)!r} for {path!r}")
    if Path(path).is_dir():
        raise InvalidParameter(f"{parameter}: {path!r} is a folder, not a file")


def check_report_paths(html_path: str | None, plot_path: str | None) -> None:
    """Fails before any work when a report could not be written where asked."""
    if html_path is not None:
        check_folder("html", html_path)
    if plot_path is not None:
        if Path(plot_path).suffix.lower() != ".png":
            raise InvalidParameter(f"plot: the file must end in .png, got {plot_path!r}")
        check_folder("plot", plot_path)


def write_reports(
    result: Any,
    html_path: str | None,
    plot_path: str | None,
    console: Console,
    html: Callable[[str, Any], None] | None = None,
    plot: Callable[[str, Any], None] | None = None,
) -> None:
    """Writes the requested report files (atomically) and says where they went; `html` and `plot`
    write another kind of result than lmtrace.render's (a KV-lab result)."""
    if html_path is not None:
        if html is None:
            from lmtrace.render.html.trace import write_html as html

        html(html_path, result)
        console.print(f"[dim]report written to {html_path}[/dim]", soft_wrap=True)
    if plot_path is not None:
        if plot is None:
            from lmtrace.render.plots.trace import write_plot as plot

        plot(plot_path, result)
        console.print(f"[dim]plot written to {plot_path}[/dim]", soft_wrap=True)
