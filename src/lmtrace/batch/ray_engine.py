"""The Ray engine: the same job on Ray Data, with an actor pool of model replicas.

Each actor loads the model once and runs the local engine's trace_lines on the lines it is
given; the driver (this process) reads the input and appends every outcome to the output
itself, so the file, its resume rule and its lock are the local engine's. Without an address
(or RAY_ADDRESS) Ray starts a local instance; with one it joins that cluster."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lmtrace import arguments
from lmtrace.batch.lines import InputLine
from lmtrace.batch.local import Outcome, trace_lines
from lmtrace.batch.prepare import OVERRIDES
from lmtrace.errors import InvalidParameter


def quiet_transformers() -> None:
    """No progress bars or warnings from transformers in a worker (the job draws its own bar)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    os.environ.setdefault("TQDM_DISABLE", "1")


def input_lines(batch: dict[str, Any]) -> list[InputLine]:
    """The input lines of a Ray Data batch (columns `number`, `line`)."""
    lines = []
    for number, text in zip(batch["number"], batch["line"]):
        data = json.loads(text)
        lines.append(InputLine(int(number), data["id"], data))
    return lines


def columns(outcomes: list[Outcome]) -> dict[str, Any]:
    """Outcomes as the columns of a Ray Data batch."""
    import numpy as np

    return {
        "key": np.array([o.key for o in outcomes], dtype=object),
        "line": np.array([o.line for o in outcomes], dtype=object),
        "tokens": np.array([o.tokens for o in outcomes], dtype=np.int64),
        "error": np.array([o.error for o in outcomes], dtype=bool),
    }


class Tracer:
    """A Ray Data actor: one model replica; each call traces a batch of input lines."""

    def __init__(self, model_kwargs: dict[str, Any], defaults: dict[str, Any], batch_size: int):
        from lmtrace.model.load import load

        quiet_transformers()
        self.lm = load(**model_kwargs)
        self.defaults = defaults
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return columns(list(trace_lines(self.lm, input_lines(batch), self.defaults, self.batch_size)))


@dataclass(frozen=True)
class RayOptions:
    """Where and how the Ray engine runs: `num_workers` replicas (an actor each), on the cluster
    at `address` (None: RAY_ADDRESS, else a local instance), `gpus_per_worker` each;
    `init_kwargs` go to ray.init when this engine starts Ray (it then shuts it down). `actor`
    (a class like Tracer) and its extra constructor `actor_kwargs` pick another engine per replica."""

    num_workers: int = 1
    address: str | None = None
    gpus_per_worker: float = 0.0
    init_kwargs: dict[str, Any] | None = None
    actor: type = Tracer
    actor_kwargs: dict[str, Any] | None = None


def _length_order(line: InputLine) -> tuple[str, int]:
    """Groups lines of the same params and of similar length next to each other before Ray
    cuts them into batches (characters stand for tokens: the driver loads no tokenizer)."""
    own = {k: line.data[k] for k in (*OVERRIDES, "chat") if k in line.data and k != "seed"}
    body = line.data.get("prompt", line.data.get("messages", ""))
    size = len(body) if isinstance(body, str) else len(json.dumps(body))
    return json.dumps(own, sort_keys=True, default=str), -size


def _init(address: str | None, init_kwargs: dict[str, Any]) -> bool:
    """Connects to Ray (or starts a local instance); True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    local = address is None and not os.environ.get("RAY_ADDRESS")
    kwargs = {"include_dashboard": False, **init_kwargs} if local else dict(init_kwargs)
    ray.init(address=address, **kwargs)
    return True


def _stream(
    pending: list[InputLine],
    on_tokens: Callable[[int], None],
    actor_kwargs: dict[str, Any],
    placement: dict[str, Any],
    actor: type = Tracer,
) -> Iterator[Outcome]:
    """Outcomes as the actors finish their batches (in no particular order)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the job draws its own bar
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ordered = sorted(pending, key=_length_order)
    items = [{"number": line.number, "line": json.dumps(line.data, ensure_ascii=False)} for line in ordered]
    traced = ray.data.from_items(items).map_batches(
        actor,
        fn_constructor_kwargs=actor_kwargs,
        batch_size=actor_kwargs["batch_size"],
        batch_format="numpy",
        **placement,
    )
    for row in traced.iter_rows():
        tokens = int(row["tokens"])
        on_tokens(tokens)
        yield Outcome(str(row["key"]), str(row["line"]), tokens, bool(row["error"]))


def ray_engine(
    model_kwargs: dict[str, Any],
    defaults: dict[str, Any],
    batch_size: int,
    options: RayOptions | None = None,
    **keywords: Any,
) -> Callable[[list[InputLine], Callable[[int], None]], Iterator[Outcome]]:
    """The engine run_job calls. `model_kwargs` are lmtrace.load's, given to every actor;
    `options` (RayOptions), or its fields as keywords: `num_workers`, `address`,
    `gpus_per_worker`, `init_kwargs` (to ray.init when this engine starts Ray; it then shuts it
    down), `actor` (a class like Tracer) and its extra constructor `actor_kwargs`."""
    o = arguments.options(RayOptions, options, "ray_engine", keywords)
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise InvalidParameter("engine: --engine ray needs Ray: pip install 'lmtrace[ray]'") from e
    if o.num_workers < 1:
        raise InvalidParameter(f"num_workers must be >= 1, got {o.num_workers}")
    if o.gpus_per_worker < 0:
        raise InvalidParameter(f"gpus_per_worker must be >= 0, got {o.gpus_per_worker}")
    constructor = {
        "model_kwargs": model_kwargs,
        "defaults": defaults,
        "batch_size": batch_size,
        **(o.actor_kwargs or {}),
    }
    # a fixed pool: every actor loads the model once, when the pool starts
    placement = {
        "compute": ray.data.ActorPoolStrategy(size=o.num_workers),
        "num_cpus": 1,
        "num_gpus": o.gpus_per_worker or None,
    }

    def run(pending: list[InputLine], on_tokens: Callable[[int], None]) -> Iterator[Outcome]:
        started = _init(o.address, o.init_kwargs or {})

        def outcomes() -> Iterator[Outcome]:
            try:
                yield from _stream(pending, on_tokens, constructor, placement, o.actor)
            finally:
                if started:
                    ray.shutdown()

        return outcomes()

    return run
