"""Tracing datasets: `lmtrace batch IN.jsonl OUT.jsonl`, resumable, locally or on Ray.

    from lmtrace.batch import local_engine, run_job
    engine = local_engine(lambda: lmtrace.load(), defaults_of(SamplingParams(temperature=0)), 8)
    summary = run_job("in.jsonl", "out.jsonl", engine)

The Ray engine (lmtrace.batch.ray_engine.ray_engine) imports Ray only when it is used."""

from lmtrace.batch.job import Progress, Summary, run_job
from lmtrace.batch.lines import InputLine, read_input
from lmtrace.batch.local import Outcome, local_engine, trace_lines
from lmtrace.batch.output import OutputFile, record_line
from lmtrace.batch.prepare import defaults_of

__all__ = [
    "InputLine",
    "Outcome",
    "OutputFile",
    "Progress",
    "Summary",
    "defaults_of",
    "local_engine",
    "read_input",
    "record_line",
    "run_job",
    "trace_lines",
]
