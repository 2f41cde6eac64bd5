"""Continuous batching: rows with their own SamplingParams decode together, and the batch
changes while it runs. A row joins at a step boundary (its prompt prefilled with the other rows
arriving at that step, or alone, its cache left-padded into the batch's), leaves as soon as it
finishes (its cache rows selected away), and every row's numbers are what it would get decoded
alone: its own generator, its own processors, its own grammar (rows with different constraints,
and none, decode together), its own part of the cache in `kv`. Greedy tokens
and seeded draws are the same as alone; logprobs differ from alone only by the float noise of
batched matrix products (the documented batched-versus-alone bound).

    batch = ContinuousBatch(lm, max_batch=16)
    row = batch.join(RowSpec(ids, params, text))   # any time between steps (join_many: several)
    while not batch.empty:
        for row in batch.step(): ...               # the rows that finished at this step
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.decode import constrained, engine
from lmtrace.decode import step as one_step
from lmtrace.decode.rows import RowRecord, seeded, step_record, to_trace
from lmtrace.detokenize import TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger as kv
from lmtrace.kv import rows as rowkv
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Step, Trace


@dataclass
class RowSpec:
    """One row to decode: its prompt (ids and text) and its own params. `on_step(step)` is
    called with each of its steps on the decoding thread; an exception it raises takes the row
    out of the batch (a server uses this when the client has gone)."""

    ids: list[int]
    params: SamplingParams
    text: str = ""
    chat: bool = False
    on_step: Callable[[Step], None] | None = None
    tag: Any = None  # the caller's own reference (a request, a line)


class Row:
    """A row while it decodes: its records, generator, penalty mask, grammar and position."""

    def __init__(self, lm: LM, spec: RowSpec):
        self.spec = spec
        self.params = seeded(spec.params)
        found = constrained.matchers(lm, [self.params])
        self.grammar = found[0] if found else None  # the row's grammar matcher (None: unconstrained)
        self.record = RowRecord(lm, self.params.stop)
        self.generator = None
        if not self.params.greedy:
            self.generator = torch.Generator(device=lm.model.device).manual_seed(self.params.seed)
        self.seen: torch.Tensor | None = None  # (1, vocab) bool, with a repetition penalty
        self.index = 0  # steps produced so far
        self.position = len(spec.ids)  # of the next token fed
        self.step_ms = 0.0
        self.trace: Trace | None = None
        self.error: BaseException | None = None


class ContinuousBatch:
    """The running batch: at most `max_batch` rows, one KV cache, one attention mask."""

    def __init__(self, lm: LM, max_batch: int = 16):
        if max_batch < 1:
            raise InvalidParameter(f"max_batch must be >= 1, got {max_batch}")
        self.lm = lm
        # a sliding-window cache cannot be regrouped: such a model decodes one row at a time
        self.max_batch = max_batch if kv.regroupable(kv.new_cache(lm.model)) else 1
        self.rows: list[Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # (batch, width): 0 on each row's left padding
        self.logits: torch.Tensor | None = None  # (batch, vocab): each row's next distribution
        self.tb = TokenBytes(lm.tokenizer)
        self.eos = set(lm.eos_token_ids)
        self._expected: dict[int, Any] = {}  # batch size -> the cache formula at that size

    @property
    def empty(self) -> bool:
        return not self.rows

    @property
    def free(self) -> int:
        return self.max_batch - len(self.rows)

    def join(self, spec: RowSpec) -> Row:
        """Prefills the row's prompt alone and adds it to the batch (call between steps)."""
        return self.join_many([spec])[0]

    def join_many(self, specs: Sequence[RowSpec]) -> list[Row]:
        """Prefills the rows' prompts together in one left-padded forward (one row: alone, so
        its first numbers are exactly the lone ones) and adds them to the batch."""
        if not specs:
            return []
        if len(specs) > self.free:
            raise RuntimeError(f"the batch has room for {self.free} rows, not {len(specs)}")
        for spec in specs:
            engine.check_context(self.lm.model, [spec.ids], spec.params)
        rows = [Row(self.lm, spec) for spec in specs]
        model = self.lm.model
        started = time.perf_counter()
        cache = kv.new_cache(model)
        ids, mask = engine.left_pad([s.ids for s in specs], self.lm.pad_token_id, model.device)  # (k, width)
        padded = bool((mask == 0).any())
        with torch.inference_mode():
            logits = engine.prefill(model, ids, mask if padded else None, cache)  # (k, vocab)
        for k, row in enumerate(rows):
            if row.params.repetition_penalty != 1.0:
                row.seen = torch.zeros((1, model.config.vocab_size), dtype=torch.bool, device=model.device)
                row.seen[0, ids[k][mask[k].bool()]] = True
            row.step_ms = (time.perf_counter() - started) * 1000
        self._merge(rows, cache, logits, mask)
        return rows

    def _merge(self, rows: list[Row], cache: Any, logits: torch.Tensor, own: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.logits = rows, cache, own, logits
            return
        width, length = self.mask.shape[1], own.shape[1]
        # left-pad whichever is shorter, so that every row's tokens end at the last column
        kv.pad_left(self.cache, length - width)
        kv.pad_left(cache, width - length)
        self.mask = _pad_mask(self.mask, length - width)
        own = _pad_mask(own, width - length)
        kv.append_rows(self.cache, cache)
        self.mask = torch.cat([self.mask, own], dim=0)
        self.logits = torch.cat([self.logits, logits], dim=0)
        self.rows += rows

    def step(self) -> list[Row]:
        """Chooses every row's next token, records it (calling the rows' `on_step`), takes the
        rows that finished out, and runs the decode forward for the others. Returns the rows
        that left at this step (a trace each, or `error` set when their `on_step` raised)."""
        if self.empty:
            return []
        started = time.perf_counter()
        with torch.inference_mode():
            tokens, bs = self._choose()
        choose_ms = (time.perf_counter() - started) * 1000
        left = [r for r in range(len(self.rows)) if self._record(r, bs, choose_ms)]
        gone = [self.rows[r] for r in left]
        if left:
            self._remove(left)
            tokens = tokens[[r for r in range(len(tokens)) if r not in set(left)]]
        if self.rows:
            self._decode(tokens)
        return gone

    def _choose(self) -> tuple[torch.Tensor, one_step.BatchStep]:
        """Each row's token from its own processed distribution; the numbers of all rows."""
        rows = self.rows
        grammars = [r.grammar for r in rows] if any(r.grammar is not None for r in rows) else None
        how = one_step.Choosing([r.params for r in rows], [r.generator for r in rows], [r.seen for r in rows],
                                grammars=grammars)  # fmt: skip
        state = kv.state(self.cache, self._formula(len(rows)))
        tokens, bs = one_step.take(0, self.logits, how, [True] * len(rows), state)
        for r, error in one_step.nothing_allowed(bs, how, [r.index for r in rows]).items():  # that row alone fails
            rows[r].error = error
        how.saw(tokens)
        return tokens, bs

    def _record(self, r: int, bs: one_step.BatchStep, choose_ms: float) -> bool:
        """Row r's Step for this batch step; True when the row leaves the batch."""
        row, token = self.rows[r], bs.token_ids[r]
        if row.error is not None:  # its grammar allowed nothing: it leaves without this step
            return True
        p = row.params
        is_eos = p.stop_on_eos and token in self.eos
        hit = row.record.add(token, is_eos)
        finish = one_step.finish_reason(is_eos, hit, row.index == p.max_new_tokens - 1)
        piece = row.record.piece + (row.record.detok.flush() if finish else "")
        if finish == "eos":
            row.record.stop_reason = token
        bs.index = row.index
        bs.time_ms = row.step_ms + choose_ms
        step = step_record(self.lm, bs, r, piece, self.tb)
        pad = int((self.mask[r] == 0).sum())
        step.kv = rowkv.own_part(step.kv, pad, len(self.rows), self._formula(1))
        row.record.steps.append(step)
        row.index += 1
        try:
            if row.spec.on_step is not None:
                row.spec.on_step(step)
        except BaseException as e:  # the row's consumer stopped it: it alone leaves
            row.error = e
            return True
        if finish is not None:
            s = row.spec
            row.trace = to_trace(self.lm, s.text, s.ids, p, row.record, s.chat)
            return True
        return False

    def _formula(self, batch: int) -> Any:
        if batch not in self._expected:
            self._expected[batch] = engine.expected_bytes(self.lm.model, batch)
        return self._expected[batch]

    def _remove(self, left: Sequence[int]) -> None:
        keep = [r for r in range(len(self.rows)) if r not in set(left)]
        self.rows = [self.rows[r] for r in keep]
        if not self.rows:
            self.cache = self.mask = self.logits = None
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        kv.select_rows(self.cache, index)
        self.mask = self.mask.index_select(0, index)
        # columns that are padding in every remaining row are dropped: the cache stays as short
        # as the longest row needs
        unused = int((self.mask == 0).sum(dim=1).min())
        kv.drop_left(self.cache, unused)
        self.mask = self.mask[:, unused:]

    def _decode(self, tokens: torch.Tensor) -> None:
        started = time.perf_counter()
        device = self.mask.device
        positions = torch.tensor([[r.position] for r in self.rows], dtype=torch.long, device=device)  # (batch, 1)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=-1)
        padded = bool((self.mask == 0).any())
        with torch.inference_mode():
            self.logits = engine.decode_step(
                self.lm.model, tokens, positions, self.mask if padded else None, self.cache
            )  # (batch, vocab)
        for row in self.rows:
            row.position += 1
            row.step_ms = (time.perf_counter() - started) * 1000


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    if width <= 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], width)), mask], dim=-1)


def generate_rows(lm: LM, specs: Sequence[RowSpec], max_batch: int = 16) -> list[Trace]:
    """Decodes every row, each with its own params, `max_batch` at a time: a row that finishes
    makes room for the next one at once. One Trace per spec, in order; a row whose `on_step`
    raised re-raises here."""
    batch = ContinuousBatch(lm, max_batch)
    waiting = list(enumerate(specs))
    out: list[Trace | None] = [None] * len(specs)
    rows: dict[int, int] = {}
    while waiting or not batch.empty:
        arriving, waiting = waiting[: batch.free], waiting[batch.free :]
        for (i, _), row in zip(arriving, batch.join_many([spec for _, spec in arriving])):
            rows[id(row)] = i
        for row in batch.step():
            if row.error is not None:
                raise row.error
            out[rows[id(row)]] = row.trace
    return out  # type: ignore[return-value]
