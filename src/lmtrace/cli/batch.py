"""`lmtrace batch IN.jsonl OUT.jsonl`: trace every line of a file, resumably, here or on Ray."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lmtrace.cli.common import cli, load_draft, load_model
from lmtrace.cli.options import (
    batch_invariant_option,
    constraint_options,
    device_map_option,
    draft_from,
    draft_options,
    inside_options,
    logits_processor_option,
    matmul_option,
    model_options,
    observer_option,
    params_from,
    sampling_options,
)
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


VLLM_ONLY = ("tensor_parallel_size", "logprobs_mode", "max_model_len", "kv_cache_gib")


def _vllm_engine(kw: dict, status: Console, defaults: dict, model_kwargs: dict):
    """--engine vllm: here, or (with --address or --num-workers) as replicas on Ray."""
    if kw["device_map"] is not None:
        raise InvalidParameter(
            f"device_map: not with --engine vllm (vLLM spreads a model with --tensor-parallel-size), "
            f"got {kw['device_map']!r}"
        )
    if kw["tensor_parallel_size"] is not None and kw["tensor_parallel_size"] < 1:
        raise InvalidParameter(f"tensor_parallel_size must be >= 1, got {kw['tensor_parallel_size']}")
    if kw["kv_cache_gib"] is not None and kw["kv_cache_gib"] <= 0:
        raise InvalidParameter(f"kv_cache_gib must be > 0, got {kw['kv_cache_gib']}")
    engine_kwargs = {
        "logprobs_mode": kw["logprobs_mode"] or "raw",
        "tensor_parallel_size": kw["tensor_parallel_size"] or 1,
        "max_model_len": kw["max_model_len"],
        "kv_cache_bytes": int(kw["kv_cache_gib"] * 2**30) if kw["kv_cache_gib"] else None,
    }
    source = kw["model"]
    if kw["address"] is None and kw["num_workers"] is None:
        from lmtrace.batch.vllm_engine import vllm_engine

        if kw["gpus_per_worker"] is not None:
            given = kw["gpus_per_worker"]
            raise InvalidParameter(f"gpus_per_worker: only on Ray (--address or --num-workers), got {given!r}")

        def load():
            options = (kw["device"], kw["dtype"], kw["allow_pickle"], kw["trust_remote_code"], None)
            return load_model(status, source, *options)

        return vllm_engine(load, source, defaults, kw["batch_size"], engine_kwargs, kw["echo"])
    from lmtrace.batch.ray_engine import ray_engine
    from lmtrace.batch.vllm_engine import VLLMTracer

    if source is not None and Path(source).expanduser().exists():  # workers start in another folder
        source = str(Path(source).expanduser().resolve())
    return ray_engine(
        {"source": source, **model_kwargs, "device_map": None},
        defaults,
        kw["batch_size"],
        num_workers=kw["num_workers"] or 1,
        address=kw["address"],
        gpus_per_worker=kw["gpus_per_worker"] or 0.0,
        actor=VLLMTracer,
        actor_kwargs={"engine_kwargs": engine_kwargs, "echo": kw["echo"]},
    )


def _engine(kw: dict, status: Console, defaults: dict):
    from lmtrace.batch.local import local_engine

    model_kwargs = {k: kw[k] for k in ("device", "dtype", "allow_pickle", "trust_remote_code", "device_map", "matmul",
                                           "batch_invariant")}  # fmt: skip
    source = kw["model"]
    if kw["engine"] != "vllm":
        for name in VLLM_ONLY:
            if kw[name] not in (None, False):
                raise InvalidParameter(f"{name}: only with --engine vllm, got {kw[name]!r}")
    if kw["engine"] != "local" and defaults.get("draft") is not None:
        raise InvalidParameter(f"draft: only with --engine local, got --engine {kw['engine']}")
    for name in ("lens", "attention"):  # vLLM's forward has no hooks of lmtrace's
        if kw["engine"] == "vllm" and kw[name]:
            raise InvalidParameter(f"{name}: --{name} runs in lmtrace's own engine; not with --engine vllm")
    if kw["engine"] == "vllm" and kw["matmul"] != "default":
        raise InvalidParameter(f"matmul: --matmul {kw['matmul']} is lmtrace's own engine's; vLLM chooses its kernels")
    if kw["engine"] == "vllm" and kw["batch_invariant"]:
        raise InvalidParameter("batch_invariant: --batch-invariant runs lmtrace's own engine; not with --engine vllm")
    if kw["engine"] == "vllm":
        return _vllm_engine(kw, status, defaults, model_kwargs)
    if kw["engine"] == "local":
        for name in ("num_workers", "address", "gpus_per_worker"):
            if kw[name] is not None:
                raise InvalidParameter(f"{name}: only with --engine ray, got {kw[name]!r}")

        def load():
            options = (kw["device"], kw["dtype"], kw["allow_pickle"], kw["trust_remote_code"], kw["device_map"])
            lm = load_model(status, source, *options, matmul=kw["matmul"], batch_invariant=kw["batch_invariant"])
            load_draft(status, lm, defaults.get("draft"))  # a bad --draft fails the job, not each line
            return lm

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
@constraint_options
@click.option("--batch-size", type=int, default=8, show_default=True, help="Lines decoded together.")
@click.option("--engine", type=click.Choice(["local", "ray", "vllm"]), default="local", show_default=True)
@click.option("--num-workers", type=int, default=None, help="Ray: model replicas (actors). Default 1.")
@click.option("--address", default=None, metavar="ADDR", help="Ray: cluster to join (else RAY_ADDRESS, else local).")
@click.option("--gpus-per-worker", type=float, default=None, help="Ray: GPUs per replica (may be fractional).")
@click.option("--tensor-parallel-size", type=int, default=None, help="vLLM: GPUs one replica is split over.")
@click.option(
    "--logprobs-mode",
    type=click.Choice(["raw", "processed"]),
    default=None,
    help="vLLM: which distribution vLLM reports (default raw); lmtrace rescores the other.",
)
@click.option("--max-model-len", type=int, default=None, help="vLLM: context length (default: the model's).")
@click.option("--kv-cache-gib", type=float, default=None, help="vLLM: memory for the paged KV cache (CPU default 1).")
@click.option("--echo", is_flag=True, default=False, help="Also record the prompt's own logprobs (every line).")
@click.option("--no-color", is_flag=True, help="Plain text, no colours.")
@inside_options
@logits_processor_option
@observer_option
@draft_options
@matmul_option
@batch_invariant_option
def batch(in_path, out_path, no_color, **kw):
    """Trace every line of IN.jsonl ({"id", "prompt" or "messages", sampling fields, a constraint})
    into OUT.jsonl ({"id", "trace"} or {"id", "error"}), appending; a rerun resumes."""
    params = params_from(kw)
    draft, draft_tokens = draft_from(kw)
    if out_path == "-":
        raise InvalidParameter("output: must be a file (a rerun reads it to resume), got '-'")
    if kw["batch_size"] < 1:
        raise InvalidParameter(f"batch_size must be >= 1, got {kw['batch_size']}")
    from lmtrace.batch.job import run_job
    from lmtrace.batch.prepare import defaults_of
    from lmtrace.decode import named_observers
    from lmtrace.logits import grammar
    from lmtrace.logits.named import registry

    grammar.check(params)  # the command's own constraint, before the model loads

    status = Console(stderr=True, no_color=no_color, highlight=False)
    defaults = {**defaults_of(params, kw["chat"]), "lens": kw["lens"], "attention": kw["attention"], "echo": kw["echo"]}
    if kw["logits_processor"]:  # the specs themselves travel (to Ray's workers too): imported where lines run
        registry(kw["logits_processor"])  # a bad spec fails the command, before the model loads
        defaults["logits_processors"] = list(kw["logits_processor"])
    if kw["observer"]:
        named_observers.registry(kw["observer"])
        defaults["observers"] = list(kw["observer"])
    if draft is not None:
        defaults.update(draft=draft, draft_tokens=draft_tokens)
    engine = _engine(kw, status, defaults)
    progress = BarProgress(status)
    try:
        summary = run_job(in_path, out_path, engine, progress)
    finally:
        progress.stop()
    _report(status, summary, out_path)
