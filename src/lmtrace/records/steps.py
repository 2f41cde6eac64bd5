"""A Step, built in one place for every path that records one: lmtrace's own loop
(decode/row_state.py), model.generate's output (external/from_generate.py), a watched loop, vLLM's
answers (vllm/convert.py), kv-lab. The numbers come as one `StepNumbers`, the alternatives from
records/alternatives.py, what only some paths record as keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmtrace.records import Alternative, Step
from lmtrace.records.alternatives import Spelling


@dataclass(frozen=True)
class StepNumbers:
    """A step's numbers: under the raw distribution (`logprob`, `rank`, `entropy`) and under the
    processed one the token was chosen from (`sampled_*`); None where that one was not recorded."""

    logprob: float | None
    sampled_logprob: float | None
    rank: int | None
    entropy: float | None
    sampled_entropy: float | None


def new_step(
    index: int, token_id: int, text: str, numbers: StepNumbers, top: list[Alternative], tb: Spelling, **extra: Any
) -> Step:
    """The Step of `token_id` (spelled by `tb`) at `index`, with `text` the piece it added; `extra`
    are Step's optional fields (kv, time_ms, waterfall, lens, attention, grammar, draft, entries)."""
    extra.setdefault("kv", {})
    extra.setdefault("time_ms", None)
    return Step(
        index=index,
        token_id=token_id,
        text=text,
        bytes=list(tb(token_id)),
        logprob=numbers.logprob,
        sampled_logprob=numbers.sampled_logprob,
        rank=numbers.rank,
        entropy=numbers.entropy,
        sampled_entropy=numbers.sampled_entropy,
        top=top,
        **extra,
    )
