"""A step's alternatives (`Step.top`), built in one place for every path that records steps:
lmtrace's own loop, model.generate's output, vLLM's answers, the server's scores."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from lmtrace.records import Alternative


class Spelling(Protocol):
    """How a token id is written: its text and its bytes (lmtrace.detokenize.TokenBytes)."""

    def text(self, token_id: int) -> str: ...

    def __call__(self, token_id: int) -> bytes: ...


def alternative(token_id: int, logprob: float | None, sampled_logprob: float | None, tb: Spelling) -> Alternative:
    """One alternative: the token spelled by `tb`, its raw and processed logprobs."""
    return Alternative(token_id, tb.text(token_id), list(tb(token_id)), logprob, sampled_logprob)


def alternatives(
    token_ids: Iterable[int], logprobs: Iterable[float | None], sampled: Iterable[float | None], tb: Spelling
) -> list[Alternative]:
    """The alternatives in order: token ids with their raw and processed logprobs."""
    return [alternative(t, lp, slp, tb) for t, lp, slp in zip(token_ids, logprobs, sampled)]
