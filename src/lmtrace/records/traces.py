"""A Trace, built in one place for every path that records one: lmtrace's own loop
(decode/row_state.py), model.generate's output, a watched loop, vLLM's answers, kv-lab. The token ids
are the steps' own, the versions those of this install unless given."""

from __future__ import annotations

from typing import Any

from lmtrace.records import Step, Trace
from lmtrace.versions import versions


def new_trace(
    steps: list[Step], *, text: str, finish_reason: str, stop_reason: str | int | None, **header: Any
) -> Trace:
    """The Trace of `steps`; `header` holds its model, params, prompt and timing entries and any of
    Trace's optional fields (kv_anatomy, prompt_logprobs, origin, distributions, fields, choices,
    speculative, entries, versions)."""
    header.setdefault("versions", versions())
    return Trace(
        text=text,
        token_ids=[s.token_id for s in steps],
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        steps=steps,
        **header,
    )
