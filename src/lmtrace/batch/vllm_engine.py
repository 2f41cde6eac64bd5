"""The vLLM engine of a batch job: `lmtrace batch IN OUT --engine vllm`.

The input lines are prepared as for the local engine (lmtrace's tokenizer, the line's own
settings, the same validation and error lines), sent to vLLM a window of `batch_size` lines at
a time (vLLM batches them continuously, settings may differ per line), and each RequestOutput
becomes the record lmtrace's own engine would write (lmtrace.vllm.convert). The file, its
resume rule and its lock are run_job's, as for every engine. With an address, replicas run as
a Ray Data actor pool (lmtrace.batch.ray_engine), each with its own vLLM engine."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

from lmtrace.batch.lines import InputLine
from lmtrace.batch.local import Outcome, error_outcome
from lmtrace.batch.output import record_line
from lmtrace.batch.prepare import Job, not_for_vllm, prepare
from lmtrace.model.lm import LM


def _outcome(job: Job, result: Any) -> Outcome:
    if isinstance(result, str):
        return error_outcome(job.line, result)
    if job.messages is not None:
        result.prompt["messages"] = job.messages
    try:
        return Outcome(job.line.key, record_line(job.line.id, result.to_dict()), len(result.steps))
    except ValueError as e:  # a number JSON cannot hold (NaN)
        return error_outcome(job.line, f"cannot write the trace as JSON ({e})")


def trace_lines_vllm(
    engine: Any,
    lines: Iterable[InputLine],
    defaults: dict[str, Any],
    batch_size: int,
    on_tokens: Callable[[int], None] | None = None,
    echo: bool = False,
) -> Iterator[Outcome]:
    """An Outcome for every line; `engine` is a lmtrace.vllm.VLLMEngine."""
    from lmtrace.decode.tracing import make_params
    from lmtrace.vllm.convert import Request

    it = iter(lines)
    while window := list(islice(it, batch_size)):
        jobs = []
        for line in window:
            job = prepare(engine.lm, line, defaults)
            if not isinstance(job, str) and (name := not_for_vllm(job)) is not None:
                job = f"{name}: the vllm engine does not run {name}; use --engine local"
            if isinstance(job, str):
                yield error_outcome(line, job)
            else:
                jobs.append(job)
        if not jobs:
            continue
        requests = []
        for job in jobs:
            p = job.params
            if not p.greedy and p.seed is None:  # as the local engine: a sampled line records its seed
                p = make_params(p, seed=random.randrange(2**31))
            requests.append(Request(job.text, job.ids, p, job.chat, echo or job.extras.echo))
        for job, result in zip(jobs, engine.trace(requests)):
            outcome = _outcome(job, result)
            if on_tokens is not None:
                on_tokens(outcome.tokens)
            yield outcome


def vllm_engine(
    load_lm: Callable[[], LM], source: str | None, defaults: dict[str, Any], batch_size: int,
    engine_kwargs: dict[str, Any], echo: bool = False,
) -> Callable[[list[InputLine], Callable[[int], None]], Iterator[Outcome]]:  # fmt: skip
    """The engine run_job calls: it loads the model and starts vLLM (once, when there is work)."""
    from lmtrace.vllm.engine import check_vllm

    check_vllm()  # a missing vLLM is said before the input is read

    def run(pending: list[InputLine], on_tokens: Callable[[int], None]) -> Iterator[Outcome]:
        from lmtrace.vllm.engine import VLLMEngine

        lm = load_lm()
        engine = VLLMEngine.start(lm, source, **engine_kwargs)
        return trace_lines_vllm(engine, pending, defaults, batch_size, on_tokens, echo)

    return run


class VLLMTracer:
    """A Ray Data actor: one vLLM replica (with tensor_parallel_size GPUs) and the lmtrace model
    that rescores; each call traces a batch of input lines."""

    def __init__(self, model_kwargs: dict[str, Any], defaults: dict[str, Any], batch_size: int,
                 engine_kwargs: dict[str, Any], echo: bool = False):  # fmt: skip
        from lmtrace.batch.ray_engine import quiet_transformers
        from lmtrace.model.load import load
        from lmtrace.vllm.engine import VLLMEngine

        quiet_transformers()
        source = model_kwargs.get("source")
        self.engine = VLLMEngine.start(load(**model_kwargs), source, **engine_kwargs)
        self.defaults, self.batch_size, self.echo = defaults, batch_size, echo

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from lmtrace.batch.ray_engine import columns, input_lines

        lines = input_lines(batch)
        return columns(list(trace_lines_vllm(self.engine, lines, self.defaults, self.batch_size, echo=self.echo)))
