"""A batch job from input file to output file, whichever engine decodes it: read the input,
skip the ids the output already holds, append each outcome as it comes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lmtrace.batch.lines import InputLine, read_input
from lmtrace.batch.local import Outcome
from lmtrace.batch.output import OutputFile
from lmtrace.errors import InvalidParameter

# engine(pending lines, on_tokens) -> outcomes: the call loads the model (run_job calls it only
# when there is work), the iteration decodes
Engine = Callable[[list[InputLine], Callable[[int], None]], Iterator[Outcome]]


class Progress(Protocol):
    def start(self, total: int, done: int) -> None: ...
    def tokens(self, n: int) -> None: ...
    def line(self, outcome: Outcome) -> None: ...


@dataclass
class Summary:
    """What a run did: lines in the input, already complete before it, written by it."""

    total: int = 0
    already_done: int = 0
    written: int = 0
    errors: int = 0
    tokens: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)  # input lines that get no output line
    repaired_bytes: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class _Quiet:
    def start(self, total: int, done: int) -> None: ...
    def tokens(self, n: int) -> None: ...
    def line(self, outcome: Outcome) -> None: ...


def run_job(in_path: str | Path, out_path: str | Path, engine: Engine, progress: Progress | None = None) -> Summary:
    """Runs the input lines whose id the output does not hold yet through `engine`. The
    output's half-written last line, if any, is cut off first; no id is written twice."""
    progress = progress or _Quiet()
    if Path(out_path).exists() and Path(in_path).resolve() == Path(out_path).resolve():
        raise InvalidParameter(f"output: {out_path} is also the input")
    lines, problems = read_input(in_path)
    summary = Summary(total=len(lines), problems=problems)
    with OutputFile(out_path) as out:
        summary.repaired_bytes = out.repaired
        pending = [line for line in lines if line.key not in out.done]
        summary.already_done = len(lines) - len(pending)
        if not pending:
            return summary
        outcomes = engine(pending, progress.tokens)  # loads the model: before the bar starts
        progress.start(len(lines), summary.already_done)
        started = time.perf_counter()
        for outcome in outcomes:
            if out.write(outcome.key, outcome.line):
                summary.written += 1
                summary.errors += outcome.error
                summary.tokens += outcome.tokens
                progress.line(outcome)
        summary.seconds = time.perf_counter() - started
    return summary
