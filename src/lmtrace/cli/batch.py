"""`lmtrace batch IN.jsonl OUT.jsonl`: trace every line of a file, resumably, here or on Ray."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lmtrace.cli.common import cli, device_map_option, load_model, model_options
from lmtrace.cli.generate import params_from, sampling_options
from lmtrace.errors import InvalidParameter

if TYPE_CHECKING:  # lmtrace.batch imports torch: the command imports it when it runs
    from lmtrace.batch.job import Summary
    from lmtrace.batch.local import Outcome


class BarProgress:
    """The job's bar on stderr: lines done/total, generated tokens/s, errors, elapsed, ETA."""

    def __init__(self, console: Console):
        columns = [
            TextColumn("Tracing"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("{task.fields[errors]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        ]
        self.bar = Progress(*columns, console=console, transient=True)
        self.task = None
        self.count = self.errors = 0
        self.started = time.perf_counter()

    def start(self, total: int, done: int) -> None:
        self.started = time.perf_counter()
        self.task = self.bar.add_task("batch", total=total, completed=done, rate="-", errors="")
        self.bar.start()

    def tokens(self, n: int) -> None:
        self.count += n
        elapsed = time.perf_counter() - self.started
        if self.task is not None and elapsed > 0:
            self.bar.update(self.task, rate=f"{self.count / elapsed:.1f}")

    def line(self, outcome: Outcome) -> None:
        self.errors += outcome.error
        self.bar.update(self.task, advance=1, errors=f"{self.errors} errors" if self.errors else "")

    def stop(self) -> None:
        self.bar.stop()


def _engine(kw: dict, status: Console, defaults: dict):
    from lmtrace.batch.local import local_engine

    model_kwargs = {k: kw[k] for k in ("device", "dtype", "allow_pickle", "trust_remote_code", "device_map")}
    source = kw["model"]
    if kw["engine"] == "local":
        for name in ("num_workers", "address", "gpus_per_worker"):
            if kw[name] is not None:
                raise InvalidParameter(f"{name}: only with --engine ray, got {kw[name]!r}")

        def load():
            options = (kw["device"], kw["dtype"], kw["allow_pickle"], kw["trust_remote_code"], kw["device_map"])
            return load_model(status, source, *options)

        return local_engine(load, defaults, kw["batch_size"])
    from lmtrace.batch.ray_engine import ray_engine

    if source is not None and Path(source).expanduser().exists():  # workers start in another folder
        source = str(Path(source).expanduser().resolve())
    return ray_engine(
        {"source": source, **model_kwargs},
        defaults,
        kw["batch_size"],
        num_workers=kw["num_workers"] or 1,
        address=kw["address"],
        gpus_per_worker=kw["gpus_per_worker"] or 0.0,
    )


def _report(status: Console, summary: Summary, out_path: str) -> None:
    def say(text: str) -> None:
        status.print(text, markup=False, highlight=False, soft_wrap=True)

    for problem in summary.problems:
        say(f"lmtrace: warning: {problem}")
    if summary.repaired_bytes:
        say(f"cut off the half-written last line of {out_path} ({summary.repaired_bytes} bytes): it is done again")
    if summary.written == 0 and summary.already_done == summary.total:
        say(f"all {summary.total} lines are already in {out_path}: nothing to do")
        return
    rate = f" ({summary.tokens_per_s:.1f} tok/s)" if summary.tokens_per_s else ""
    say(
        f"{summary.written} lines written to {out_path} ({summary.errors} errors), "
        f"{summary.already_done} already done, {summary.total} in all; "
        f"{summary.tokens} tokens generated in {summary.seconds:.1f} s{rate}"
    )


@cli.command()
@click.argument("in_path", metavar="IN.jsonl")
@click.argument("out_path", metavar="OUT.jsonl")
@model_options
@device_map_option
@sampling_options
@click.option("--batch-size", type=int, default=8, show_default=True, help="Lines decoded together.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--num-workers", type=int, default=None, help="Ray: model replicas (actors). Default 1.")
@click.option("--address", default=None, metavar="ADDR", help="Ray: cluster to join (else RAY_ADDRESS, else local).")
@click.option("--gpus-per-worker", type=float, default=None, help="Ray: GPUs per replica (may be fractional).")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
def batch(in_path, out_path, no_color, **kw):
    """Trace every line of IN.jsonl ({"id", "prompt" or "messages", sampling fields}) into
    OUT.jsonl ({"id", "trace"} or {"id", "error"}), appending; a rerun resumes."""
    params = params_from(kw)
    if out_path == "-":
        raise InvalidParameter("output: must be a file (a rerun reads it to resume), got '-'")
    if kw["batch_size"] < 1:
        raise InvalidParameter(f"batch_size must be >= 1, got {kw['batch_size']}")
    from lmtrace.batch.job import run_job
    from lmtrace.batch.prepare import defaults_of

    status = Console(stderr=True, no_color=no_color, highlight=False)
    engine = _engine(kw, status, defaults_of(params, kw["chat"]))
    progress = BarProgress(status)
    try:
        summary = run_job(in_path, out_path, engine, progress)
    finally:
        progress.stop()
    _report(status, summary, out_path)
