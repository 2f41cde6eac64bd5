"""Continuous batching: rows with their own SamplingParams decode together, and the batch
changes while it runs. A row joins at a step boundary (its prompt prefilled with the other rows
arriving at that step, or alone, its cache left-padded into the batch's), leaves as soon as it
finishes (its cache rows selected away), and every row's numbers are what it would get decoded
alone: its own generator, its own processors, its own grammar (rows with different constraints,
and none, decode together), its own part of the cache in `kv`. Greedy tokens
and seeded draws are the same as alone; logprobs differ from alone only by the float noise of
batched matrix products (the documented batched-versus-alone bound). A row may ask for the logit
lens and the attention (decode/row_inside.py: captured for it alone, the others' numbers
untouched) and for a draft (decode/drafted.py: it decodes a speculative block per batch step
with its own caches, exactly as alone). Prompts that join while rows decode may be prefilled in
the batch's decode forward (`step(joining)`: the step rides in their tree forward,
decode/tree_prefill.Ride), so that a join costs no forward of its own. With `overlap` (the server's),
a step's numbers are measured and its rows recorded on a thread beside the next forward, which
starts as soon as the tokens are chosen (rows with a grammar, observers, the lens or the
attention are measured first, as without it); the numbers are the same, computed from the same
logits.

    batch = ContinuousBatch(lm, max_batch=16)
    row = batch.join(RowSpec(ids, params, text))   # any time between steps (join_many: several)
    while not batch.empty:
        for row in batch.step(): ...               # the rows that finished at this step
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import torch

from lmtrace.decode import engine, row_inside
from lmtrace.decode.choosing import Rows, choosing
from lmtrace.decode.drafted import DraftedRow, drafted
from lmtrace.decode.loop import Fed, Once, Watch, drive
from lmtrace.decode.observers import inside_entry
from lmtrace.decode.prefill import Prefilled, PromptRow, prefill_many, stack_left
from lmtrace.decode.row_state import RowSpec, RowState, record
from lmtrace.decode.step import BatchStep, Choosing
from lmtrace.decode.tree_prefill import Ride
from lmtrace.detokenize import TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger, row_part
from lmtrace.logits import forced, measure, processors
from lmtrace.model.lm import LM
from lmtrace.records import Trace

__all__ = ["ContinuousBatch", "Joining", "RowSpec", "RowState", "first_steps", "generate_rows"]

ROOM = 32  # positions the batch's cache grows by at a time: a step writes its new one in place

# prompts joining at a step: given the batch's decode step to ride in their forward (None when no
# row decodes, or one asks for the lens or the attention), prefills them (setting the ride's
# results when it rode) and returns the rows to join with their prefills, or None
Joining = Callable[[Ride | None], tuple[Sequence[RowSpec], Sequence[Prefilled]] | None]


class ContinuousBatch:
    """The running batch: at most `max_batch` rows, one KV cache, one attention mask."""

    def __init__(self, lm: LM, max_batch: int = 16, stats: Counter | None = None, overlap: bool = False):
        if max_batch < 1:
            raise InvalidParameter(f"max_batch must be >= 1, got {max_batch}")
        self.lm = lm
        # a sliding-window cache cannot be regrouped: such a model decodes one row at a time
        self.max_batch = max_batch if ledger.regroupable(ledger.new_cache(lm.model)) else 1
        self.rows: list[RowState] = []  # the rows that step together
        self.drafted: list[DraftedRow] = []  # the rows that decode a block per step with their draft
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # (batch, width): 0 on each row's left padding
        self.logits: torch.Tensor | None = None  # (batch, vocab): each row's next distribution
        self.tb = TokenBytes(lm.tokenizer)
        self._expected: dict[int, Any] = {}  # batch size -> the cache formula at that size
        # "steps": decode forwards; "ridden": those that also prefilled joining prompts
        self.stats = stats if stats is not None else Counter()
        # measure and record a step beside the next forward (each row's on_step is then called
        # on that thread): "overlapped" counts the steps measured so (the last of a batch has no forward)
        self.overlap = overlap
        self._beside: ThreadPoolExecutor | None = None  # the measuring thread, started at the first such step

    @property
    def empty(self) -> bool:
        return not self.rows and not self.drafted

    @property
    def members(self) -> list[RowState]:
        """Every row in the batch: those stepping together and those with a draft."""
        return self.rows + [d.row for d in self.drafted]

    @property
    def free(self) -> int:
        return self.max_batch - len(self.rows) - len(self.drafted)

    def join(self, spec: RowSpec) -> RowState:
        """Prefills the row's prompt alone and adds it to the batch (call between steps)."""
        return self.join_many([spec])[0]

    def join_many(self, specs: Sequence[RowSpec]) -> list[RowState]:
        """Prefills the rows' prompts together in one left-padded forward (one row: alone, so
        its first numbers are exactly the lone ones) and adds them to the batch."""
        if not specs:
            return []
        if len(specs) > self.free:
            raise RuntimeError(f"the batch has room for {self.free} rows, not {len(specs)}")
        for spec in specs:
            engine.check_context(self.lm.model, [spec.ids], spec.params)
        joined = [RowState.joining(self.lm, spec) for spec in specs]
        self.drafted += [DraftedRow(self.lm, row) for row in joined if drafted(row.spec)]
        rows = [row for row in joined if not drafted(row.spec)]
        if not rows:
            return joined
        echoing = [row for row in rows if row.spec.echo]
        if echoing and len(echoing) < len(rows):  # the prompts measured in a forward of their own
            self._prefill([row for row in rows if not row.spec.echo])
            rows = echoing
        self._prefill(rows)
        return joined

    def _prefill(self, rows: list[RowState]) -> None:
        """The rows' prompts in one left-padded forward (with echo, every position's logits kept:
        their own numbers, as generate's), merged into the batch."""
        model = self.lm.model
        started = time.perf_counter()
        cache = ledger.new_cache(model)
        ids, mask = engine.left_pad([r.spec.ids for r in rows], self.lm.pad_token_id, model.device)  # (k, width)
        padded = bool((mask == 0).any())
        echo = rows[0].spec.echo
        with torch.inference_mode(), row_inside.around(model, rows, mask):
            logits = engine.prefill(model, ids, mask if padded else None, cache, all_positions=echo)
            if echo:  # (k, width, vocab): the prompt's own numbers, then the next token's distribution
                for k, row in enumerate(rows):
                    start = int((mask[k] == 0).sum())  # left padding
                    numbers = measure.targets(logits[k, start:-1], ids[k, start + 1 :], row.params.top_logprobs)
                    _echoed(self.lm, row, row.spec.ids, numbers, self.tb)
                logits = logits[:, -1, :]
        for row in rows:
            row.seen = _seen(model, row, row.spec.ids)
            row.step_ms = (time.perf_counter() - started) * 1000
        self._merge(rows, cache, logits, mask)

    def join_prefilled(self, specs: Sequence[RowSpec], prefilled: Sequence[Prefilled]) -> list[RowState]:
        """Adds rows whose prompts were prefilled elsewhere (lmtrace.decode.prefill: batched,
        from a prefix cache, each with its KV), one Prefilled per spec (the choices of one
        prompt share one): their caches left-padded into one and merged into the batch's."""
        if len(specs) > self.free:
            raise RuntimeError(f"the batch has room for {self.free} rows, not {len(specs)}")
        if any(drafted(s) or row_inside.wants(s) for s in specs):
            raise ValueError("rows with a draft, lens or attention join with join_many (their own prefill)")
        model = self.lm.model
        rows = [RowState.joining(self.lm, spec) for spec in specs]
        width = max(len(p.ids) for p in prefilled)
        cache = ledger.cache_of(model, stack_left([p.kv for p in prefilled], width))  # (k, kv_heads, width, head_dim)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=model.device)
        for k, (row, p) in enumerate(zip(rows, prefilled)):
            mask[k, width - len(p.ids) :] = 1
            row.seen = _seen(model, row, p.ids)
            row.step_ms, row.cached = p.ms, p.cached
            _echoed(self.lm, row, p.ids, p.numbers, self.tb)
        self._merge(rows, cache, torch.stack([p.logits for p in prefilled]), mask)
        return rows

    def _merge(self, rows: list[RowState], cache: Any, logits: torch.Tensor, own: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.logits = rows, ledger.with_room(cache, ROOM), own, logits
            return
        width, length = self.mask.shape[1], own.shape[1]
        # whichever is shorter is left-padded, so that every row's tokens end at the last column
        ledger.join_rows(self.cache, cache)
        self.mask = torch.cat([_pad_mask(self.mask, length - width), _pad_mask(own, width - length)], dim=0)
        self.logits = torch.cat([self.logits, logits], dim=0)
        self.rows += rows

    def step(self, joining: Joining | None = None) -> list[RowState]:
        """Decodes each drafted row's next block; then chooses every other row's next token,
        records it (calling the rows' `on_step`), takes the rows that finished out, and runs the
        decode forward for the others: in the forward of the `joining` prompts when they take
        the ride, whose rows then join. Returns the rows that left at this step (a trace each,
        or `error` set when their `on_step` raised). The step is decode/loop.py's `drive` over a
        `Stepping`; with `overlap` (rows without a grammar, observers, lens, attention or
        processors) it is measured and recorded beside the forward."""
        gone = [d.row for d in self.drafted if d.block(self.tb)]
        self.drafted = [d for d in self.drafted if d.row not in gone]
        if not self.rows:
            self.forward(None, joining)
            return gone
        beside = None
        if self.overlap and all(_plain(r) for r in self.rows):
            if self._beside is None:  # the measuring thread, started at the first such step
                self._beside = ThreadPoolExecutor(1, thread_name_prefix="lmtrace-measure")
            beside = self._beside
        source = Stepping(self, joining, beside)
        for _ in drive(source):
            pass
        if beside is not None:
            self.stats["overlapped"] += 1
            late = {id(row) for row in source.left}
            out = [r for r in range(len(self.rows)) if id(self.rows[r]) in late]
            if out:  # ended by its record after the forward started: its row of that forward unused
                self.take_out(out, logits=True)
        return gone + source.left

    def forward(self, tokens: torch.Tensor | None, joining: Joining | None) -> None:
        """The step's forward: the rows' decode step (riding in the joining prompts' forward
        when they take it), then the joined rows merged in."""
        ride = self._ride(tokens) if joining is not None and self.rows else None
        started = time.perf_counter()
        joined = joining(ride) if joining is not None else None
        if ride is not None and ride.logits is not None:
            self._took(ride, started)
            self.stats["ridden"] += 1
        elif self.rows:
            self._decode(tokens)
        self.stats["steps"] += 1 if self.rows else 0
        if joined:
            self.join_prefilled(*joined)

    def _ride(self, tokens: torch.Tensor) -> Ride | None:
        """The decode step as a ride (None where a row's lens or attention hooks the forward)."""
        if any(row_inside.wants(r.spec) for r in self.rows):
            return None
        positions = torch.tensor([r.position for r in self.rows], dtype=torch.long, device=self.mask.device)
        return Ride(ledger.layers_of(self.cache), self.mask, tokens, positions)

    def _took(self, ride: Ride, started: float) -> None:
        """The decode step's results from the forward it rode in."""
        with torch.inference_mode():
            ledger.append_columns(self.cache, ride.new)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=-1)
        self.logits = ride.logits
        for row in self.rows:
            row.position += 1
            row.step_ms = (time.perf_counter() - started) * 1000

    def formula(self, batch: int) -> Any:
        if batch not in self._expected:
            self._expected[batch] = engine.expected_bytes(self.lm.model, batch)
        return self._expected[batch]

    def take_out(self, left: Sequence[int], logits: bool = False) -> None:
        """Takes rows out of the batch (with `logits`, out of the next step's logits too)."""
        keep = [r for r in range(len(self.rows)) if r not in set(left)]
        self.rows = [self.rows[r] for r in keep]
        if not self.rows:
            self.cache = self.mask = self.logits = None
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        ledger.select_rows(self.cache, index)
        self.mask = self.mask.index_select(0, index)
        if logits:
            self.logits = self.logits.index_select(0, index)
        # columns that are padding in every remaining row are dropped: the cache stays as short
        # as the longest row needs
        unused = int((self.mask == 0).sum(dim=1).min())
        ledger.drop_left(self.cache, unused)
        self.mask = self.mask[:, unused:]

    def _decode(self, tokens: torch.Tensor) -> None:
        started = time.perf_counter()
        device = self.mask.device
        positions = torch.tensor([[r.position] for r in self.rows], dtype=torch.long, device=device)  # (batch, 1)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=-1)
        padded = bool((self.mask == 0).any())
        with torch.inference_mode(), row_inside.around(self.lm.model, self.rows, self.mask):
            self.logits = engine.decode_step(
                self.lm.model, tokens, positions, self.mask if padded else None, self.cache
            )  # (batch, vocab)
        for row in self.rows:
            row.position += 1
            row.step_ms = (time.perf_counter() - started) * 1000


def _ends(row: RowState, index: int, token: int, eos: Sequence[int]) -> bool:
    """Whether the row ends with this token at its step `index` whatever its record finds: its
    length, its end token."""
    return index == row.params.max_new_tokens - 1 or (row.params.stop_on_eos and token in eos)


class Stepping:
    """One step of a continuous batch's rows as the loop's source (decode/loop.py): each row at its
    own step, with its own rule (`rows_choosing`); a row whose grammar allowed nothing fails
    alone; the lens and attention of the rows that asked; each row's record; then the rows that
    left taken out and the others' forward (riding in the `joining` prompts' when they take it).
    With `beside` the step is measured and recorded on that thread while the forward runs: the
    rows that surely end here (their length, their end token) are taken out first; `left` then
    holds the rows that leave, some still in the batch (the caller takes them out after)."""

    def __init__(self, batch: ContinuousBatch, joining: Joining | None, beside: Executor | None):
        self.batch, self.joining, self.beside = batch, joining, beside
        self.rows = list(batch.rows)
        self.fed: Fed | None = None
        self.left: list[RowState] = []

    def next(self) -> Fed | None:
        if self.fed is not None:  # one step
            return None
        batch, rows = self.batch, self.rows
        state = ledger.state(batch.cache, batch.formula(len(rows)))
        watch = Watch(wanted=[r.spec.observers for r in rows], indices=[r.index for r in rows], failed={})
        # read before the step (and, beside the forward, the measuring thread) moves the rows on
        self.pads = (batch.mask == 0).sum(dim=1).tolist()  # each row's left padding
        self.forward_ms = [r.step_ms for r in rows]
        self.fed = Fed(0, batch.logits, rows_choosing(rows), [True] * len(rows), state, watch, beside=self.beside)
        return self.fed

    def chose(self, tokens: torch.Tensor, bs: BatchStep) -> None:
        """A failed grammar's error on its row, the rows' lens and attention; beside the forward,
        each row's record (the thread's part)."""
        rows, batch = self.rows, self.batch
        for r, error in (self.fed.watch.failed or {}).items():
            rows[r].error = error
        if self.beside is not None:
            self.left = [rows[r] for r in self._recorded(bs)]
            return
        inside = inside_entry(*row_inside.take(batch.lm.model, rows, batch.logits, tokens))
        if inside is not None:
            bs.entries["inside"] = inside

    def _recorded(self, bs: BatchStep) -> list[int]:
        """Each row's record of the step; the rows that leave (their places in `rows`)."""
        batch, rows, choose_ms = self.batch, self.rows, bs.time_ms  # read once: a record sets bs.time_ms
        kv, one = bs.kv.to_dict(), batch.formula(1)
        out = []
        for r, row in enumerate(rows):
            own = row_part.own_part(kv, self.pads[r], len(rows), one)
            if record(batch.lm, row, bs, r, own, choose_ms, batch.tb, forward_ms=self.forward_ms[r]):
                out.append(r)
        return out

    def took(self, tokens: torch.Tensor, bs: BatchStep | None) -> None:
        """The rows that leave taken out (with the step measured beside: those that surely end),
        the others' forward."""
        batch, rows = self.batch, self.rows
        if bs is not None:
            out = self._recorded(bs)
            self.left = [rows[r] for r in out]
        else:
            eos, indices = batch.lm.eos_token_ids, self.fed.watch.indices
            out = [r for r, t in enumerate(tokens.tolist()) if _ends(rows[r], indices[r], t, eos)]
        if out:
            batch.take_out(out)
            tokens = tokens[[r for r in range(len(rows)) if r not in set(out)]]
        batch.forward(tokens, self.joining)


def _plain(row: RowState) -> bool:
    """A row whose step can be measured beside the next forward: no grammar to move past its token,
    no observers or lens or attention reading the forward, no processors of the user's."""
    s = row.spec
    return row.grammar is None and not s.observers and not row_inside.wants(s) and not s.logits_processors


def rows_choosing(rows: Sequence[RowState]) -> Choosing:
    """How the rows choose: each with its own params, generator, penalty, grammar and processors
    (handed the row's tokens generated so far)."""
    grammars = [r.grammar for r in rows] if any(r.grammar is not None for r in rows) else None
    own = [r.spec.logits_processors for r in rows] if any(r.spec.logits_processors for r in rows) else None
    made = [[s.token_id for s in r.steps] for r in rows] if own is not None else None
    seen = [r.seen for r in rows]
    return choosing(Rows([r.params for r in rows], [r.generator for r in rows], None, made, seen, grammars, (), own))


def _echoed(lm: LM, row: RowState, ids: Sequence[int], numbers: measure.Forced | None, tb: TokenBytes) -> None:
    """A row with echo: its prompt's own numbers (its prefill's) as its trace's prompt_logprobs."""
    if not row.spec.echo:
        return
    if numbers is None:
        raise ValueError("a row with echo joins with its prompt measured (PromptRow's top_n)")
    row.prompt_logprobs = forced.token_scores(lm.tokenizer, list(ids), 0, numbers, tb)


def _seen(model, row: RowState, ids: Sequence[int]) -> torch.Tensor | None:
    """The prompt's tokens as seen, for a repetition penalty (None without one)."""
    return processors.seen_mask(row.params, [ids], model.config.vocab_size, model.device)


def first_steps(lm: LM, specs: Sequence[RowSpec], prefilled: Sequence[Prefilled]) -> list[RowState]:
    """Rows whose only step is the first (max_new_tokens 1: an evaluation's scoring request):
    chosen from the prefill's distribution, no decode forward, no batch joined; each step's
    `kv` is the row's own cache after its prefill. Each row comes back with its trace (or its
    `error`, when its `on_step` raised)."""
    rows = [RowState.joining(lm, spec) for spec in specs]
    for row, p in zip(rows, prefilled):
        if row.params.max_new_tokens != 1:
            raise ValueError(f"first_steps takes rows with max_new_tokens 1, got {row.params.max_new_tokens}")
        row.seen = _seen(lm.model, row, p.ids)
        row.step_ms, row.cached = p.ms, p.cached
    started = time.perf_counter()
    formula = engine.expected_bytes(lm.model, 1)
    states = {id(p): ledger.state(ledger.cache_of(lm.model, p.kv), formula) for p in prefilled}
    tb = TokenBytes(lm.tokenizer)
    for row, p in zip(rows, prefilled):
        _echoed(lm, row, p.ids, p.numbers, tb)
    how = rows_choosing(rows)
    logits = torch.stack([p.logits for p in prefilled])  # (k, vocab)
    watch = Watch(wanted=[r.spec.observers for r in rows], failed={})
    [(_, bs)] = drive(Once(Fed(0, logits, how, [True] * len(rows), states[id(prefilled[0])], watch)))
    for r, error in watch.failed.items():
        rows[r].error = error
    choose_ms = (time.perf_counter() - started) * 1000
    for r, (row, p) in enumerate(zip(rows, prefilled)):
        record(lm, row, bs, r, states[id(p)].to_dict(), choose_ms, tb)
    return rows


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    if width <= 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], width)), mask], dim=-1)


def generate_rows(lm: LM, specs: Sequence[RowSpec], max_batch: int = 16, overlap: bool = False) -> list[Trace]:
    """Decodes every row, each with its own params, `max_batch` at a time: a row that finishes
    makes room for the next one at once (its prompt prefilled in the batch's next decode
    forward). One Trace per spec, in order; a row whose `on_step` raised re-raises here. With
    `overlap`, each step is measured beside the next forward (ContinuousBatch's `overlap`)."""
    batch = ContinuousBatch(lm, max_batch, overlap=overlap)
    waiting = list(enumerate(specs))
    out: list[Trace | None] = [None] * len(specs)
    index: dict[int, list[int]] = {}  # id of a spec -> the places it has in `specs`
    for i, spec in waiting:
        index.setdefault(id(spec), []).append(i)
    while waiting or not batch.empty:
        arriving, waiting = waiting[: batch.free], waiting[batch.free :]
        running = bool(batch.rows)  # then a prompt that can rides in the next decode forward
        riding = [spec for _, spec in arriving if running and rides(spec)]
        batch.join_many([spec for _, spec in arriving if not (running and rides(spec))])
        for row in batch.step(prefilling(lm, riding) if riding else None):
            if row.error is not None:
                raise row.error
            out[index[id(row.spec)].pop(0)] = row.trace
    return out  # type: ignore[return-value]


def rides(spec: RowSpec) -> bool:
    """Whether the row's prompt may be prefilled in a running batch's decode forward (not with
    a draft's own caches, nor with the lens's or the attention's hooks on its prefill)."""
    return not drafted(spec) and not row_inside.wants(spec)


def _measured(spec: RowSpec) -> int | None:
    """How a row's prompt is measured in its prefill: with echo, its alternatives (None: not at all)."""
    return spec.params.top_logprobs if spec.echo else None


def prefilling(lm: LM, specs: Sequence[RowSpec]) -> Joining:
    """Prompts joining at a step, prefilled together in the batch's decode forward (each as if
    alone: no prefix cache)."""

    def prefill(ride: Ride | None) -> tuple[Sequence[RowSpec], list[Prefilled]]:
        rows = [PromptRow(list(spec.ids), _measured(spec), share=False) for spec in specs]
        return specs, prefill_many(lm.model, rows, pad_id=lm.pad_token_id, keep_kv=True, ride=ride)

    return prefill
