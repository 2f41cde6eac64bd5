"""The attribution observer: at each step, the logit difference between the chosen token and
another, split over the embedding, each layer's attention and MLP, and each head
(inside/attribution.py for the math). `lmtrace.generate(..., attribution=True)` registers it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lmtrace.decode.observers import Observer
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.detokenize import TokenBytes
from lmtrace.inside import attribution as dla


class Attribution(Observer):
    """`step.attribution`: {token_id, against_token_id, against_text, logit_diff, parts:
    [{component, value}], heads: [{layer, head, value}]}, the parts summing to logit_diff.
    `against`: "rank:N" (default rank:2, the runner-up), a token id or a token's text."""

    name = "attribution"

    def __init__(self, lm: Any, against: str | int = dla.DEFAULT_AGAINST):
        vocab = lm.model.config.get_text_config().vocab_size
        self.against = dla.resolve_against(against, lm.tokenizer, vocab)
        self.spec = str(against)
        self.text = TokenBytes(lm.tokenizer).text
        self.anatomy: dla.Anatomy | None = None
        self.parts: dla.Parts | None = None
        self.own: dla.Parts | None = None  # a continuous batch's row: what its last forward captured for it
        self.span = 1  # the last positions the next forward's hooks keep (a verify forward: several)
        self.at = 0  # which of the kept positions the next step reads

    @contextlib.contextmanager
    def attached(self, model: Any) -> Iterator[None]:
        self.prepared(model)  # refuses an architecture it cannot split, before any forward
        with dla.capturing(self.anatomy, lambda: self.span) as parts:
            self.parts = parts
            yield

    def observe(self, step: BatchStep, logits: torch.Tensor, tokens: torch.Tensor, how: Choosing) -> list[dict]:
        return self._records(dla.at(self.parts, self.at), logits, tokens)

    def positions(self, n: int) -> None:
        self.span, self.at = n, 0

    def select(self, at: int) -> None:
        self.at = at

    def _records(self, parts: dla.Parts, logits: torch.Tensor, tokens: torch.Tensor) -> list[dict]:
        other = dla.against_ids(self.against, logits, tokens)
        records = dla.attribute(self.anatomy, parts, logits, tokens, other)
        for r in records:
            r["against_text"] = self.text(r["against_token_id"])
        return records

    def snapshot(self) -> Any:
        """The parts the last forward left (its lists copied: the hooks refill them in place)."""
        p = self.parts
        return (
            None
            if p is None
            else dataclasses.replace(
                p, attn=list(p.attn), mlp=list(p.mlp), heads_in=list(p.heads_in), post_in=list(p.post_in)
            )
        )

    def restore(self, saved: Any, seqs: Sequence[Sequence[int]]) -> None:
        if saved is None or self.parts is None:
            return
        for name in ("attn", "mlp", "heads_in", "post_in"):
            getattr(self.parts, name)[:] = getattr(saved, name)
        self.parts.embed, self.parts.final = saved.embed, saved.final

    # a row of a continuous batch (decode/row_inside.py): the instance is that row's own; the
    # forward that makes its next distribution runs with the hooks, and the row keeps its part

    def prepared(self, model: Any) -> dla.Anatomy:
        """The model's anatomy, found once (before any hook goes on: it runs the norms)."""
        if self.anatomy is None:
            self.anatomy = dla.anatomy(model)
        return self.anatomy

    def keep(self, parts: dla.Parts) -> None:
        """The row's own captures ((1, ...) tensors) of the forward that made its next distribution."""
        self.own = parts

    def observe_rows(
        self,
        step: BatchStep,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        how: Choosing,
        rows: Sequence[int],
        indices: Sequence[int],
    ) -> list | None:
        """The asking row's record from its own captures (generate's whole batch where it has none)."""
        if self.own is None:
            return self.observe(step, logits, tokens, how)
        out: list = [None] * len(tokens)
        for r in rows:
            out[r] = self._records(self.own, logits[r : r + 1], tokens[r : r + 1])[0]
        return out


def wanted(lm: Any, attribution: bool, against: str | int | None, *, compile: bool = False) -> list[Observer]:
    """[Attribution] where asked for (else []), its combinations checked: a compiled step's forward
    runs inside its graph, where the hooks do not (a draft's verify forward keeps each position)."""
    from lmtrace.errors import InvalidParameter

    if attribution not in (True, False, None):
        raise InvalidParameter(f"attribution must be true or false, got {attribution!r}")
    if not attribution:
        if against is not None:
            raise InvalidParameter(f"against needs attribution, got against={against!r} without it")
        return []
    if compile:
        raise InvalidParameter("compile cannot be combined with attribution, got compile=True")
    return [Attribution(lm, dla.DEFAULT_AGAINST if against is None else against)]
