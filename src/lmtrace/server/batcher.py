"""Concurrent requests decoded together. One model thread drives a ContinuousBatch: a request
that arrives while the model is busy joins the running batch at the next step boundary (each of
its choices a row, with the request's own sampling parameters), a row that finishes leaves at
once, and a request whose client went away (or that the server's shutdown cancels) takes its
rows out at the next step. Admission, 429 with Retry-After, drain and shutdown are the
ModelWorker's own; only what runs on the model thread differs.

Each answer is what it would be alone (lmtrace.decode.continuous): greedy tokens, seeded draws (choice
j of a request with `seed` s draws from its own generator seeded s + j), each step's `kv` the
row's own part of the cache; logprobs differ from alone only by batched float noise."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from lmtrace.decode.continuous import ContinuousBatch, Joining, RowSpec, RowState
from lmtrace.decode.prefill import Prefilled
from lmtrace.decode.tree_prefill import Ride
from lmtrace.model.lm import LM
from lmtrace.records import Step, Trace
from lmtrace.server.lane import DEFAULT_PREFIX_CACHE_BYTES, Lane
from lmtrace.server.prepare import row_options
from lmtrace.server.worker import Cancelled, Handle, ModelWorker, ShuttingDown, Work

if TYPE_CHECKING:
    from lmtrace.server.prepare import Job

IDLE_WAIT_S = 0.5
# a request holds at most all but max_batch // RESERVED_PART of the batch's rows (at least one
# kept from a batch of 4 or more; 16: 14), so a request that arrives while a large one runs
# joins at the next step
RESERVED_PART = 8


class _Request:
    """An admitted request on the model thread: its rows' traces as they finish."""

    def __init__(self, handle: Handle, job: Job, loop: asyncio.AbstractEventLoop):
        self.handle, self.job, self.loop = handle, job, loop
        self.traces: list[Trace | None] = [None] * job.choices
        self.left = job.choices
        self.closed = False
        self.started = time.perf_counter()
        self.announced: set[int] = set()  # prompts whose echo and cached count were sent

    def on_step(self, choice: int):
        def hook(step: Step) -> None:
            if self.closed or self.handle.cancelled:
                raise Cancelled
            self.handle.emit(("step", choice, step))

        return hook


class BatchingWorker(ModelWorker):
    """Admits at most `limit` requests; decodes up to `max_batch` rows together."""

    def __init__(self, lm: LM, limit: int, max_batch: int, prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
        super().__init__(limit)
        self.lm, self.max_batch = lm, max_batch
        self.lane = Lane(lm, prefix_cache_bytes)
        self._waiting: deque[_Request] = deque()
        self._rows: deque[tuple[_Request, RowSpec]] = deque()  # admitted, not yet in the batch
        # whole works of the other routes (branch, score): run on the model thread between two
        # steps of the batch
        self._exclusive: deque[tuple[Handle, Work]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.peak_rows = 0  # the most rows decoded together so far (for tests and the bench)
        self._late: list[tuple[_Request, RowSpec]] = []  # rows whose prefill in a step failed
        self.stats: Counter = Counter()  # the batch's decode steps, and those that prefilled joining rows

    def submit_job(self, job: Job) -> Handle:
        """Queues the request's rows (call from the event loop); raises Busy when full."""
        handle = self._admit()
        self._queue(self._waiting, _Request(handle, job, handle.loop))
        return handle

    def submit(self, work: Work) -> Handle:
        """Queues a whole work for the model thread (call from the event loop); Busy when full."""
        handle = self._admit()
        self._queue(self._exclusive, (handle, work))
        return handle

    def _queue(self, line: deque, item: Any) -> None:
        with self._wake:
            line.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lmtrace-batch", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run_exclusive(self, handle: Handle, work: Work, run: bool = True) -> None:
        if run:
            self._run(handle, work)  # emits the work's events, frees its slot, then its end
        else:  # dropped at shutdown before it ran
            self.end(handle)

    def _loop(self) -> None:
        batch = ContinuousBatch(self.lm, self.max_batch, self.stats, overlap=True)
        while True:
            with self._wake:
                while not (self._stopped or self._waiting or self._rows or self._exclusive or not batch.empty):
                    self._wake.wait(IDLE_WAIT_S)
                if self._stopped:
                    break
                arrived = list(self._waiting)
                self._waiting.clear()
                exclusive = list(self._exclusive)
                self._exclusive.clear()
            for handle, work in exclusive:
                self._run_exclusive(handle, work)
            self._open(arrived)
            riding = self._join(batch)
            if batch.empty:
                continue
            try:
                gone = batch.step(self._joining(riding) if riding else None)
            except BaseException as e:  # the forward pass failed: every row in it fails
                for req in [*(row.spec.tag[0] for row in batch.members), *(req for req, _ in riding)]:
                    self._close(req, e)
                batch = ContinuousBatch(self.lm, self.max_batch, self.stats, overlap=True)
                continue
            for row in gone:
                self._leave(row)
            if self._late:  # their prefill in the step failed: one of them is at fault
                late, self._late = self._late, []
                self._join_rows(batch, late, retry=True)
            self.peak_rows = max(self.peak_rows, len(batch.members))
        for req in [*self._waiting, *(r for r, _ in self._rows), *(row.spec.tag[0] for row in batch.members)]:
            self._close(req, Cancelled())
        for handle, work in list(self._exclusive):
            self._run_exclusive(handle, work, run=False)

    def _open(self, arrived: list[_Request]) -> None:
        """Requests that need no decode step are answered now, their prompts prefilled
        together; the others' rows wait in line for room in the batch."""
        at_once = []
        for req in arrived:
            if req.handle.cancelled:
                self._close(req, Cancelled())
            elif self.lane.at_once(req.job) and not (req.job.generate and _own_prefill(req.job)):
                at_once.append(req)
            else:
                self._line_up(req)
        if at_once:
            self._answer(at_once)

    def _answer(self, reqs: list[_Request]) -> None:
        wanted = [(req, i) for req in reqs for i in range(len(req.job.prompts))]
        try:
            found = self.lane.prefill(wanted, keep_kv=any(req.job.generate for req in reqs))
        except BaseException as e:  # one of them is at fault: each alone, so the others still answer
            if len(reqs) > 1:
                for req in reqs:
                    self._answer([req])
            else:
                self._close(reqs[0], e)
            return
        for req in reqs:
            try:
                rows = self.lane.answer(req, found, [spec for _, spec in self._specs(req)])
            except BaseException as e:
                self._close(req, e)
                continue
            for row in rows:
                self._leave(row)
            if not req.job.generate:
                req.handle.emit(("done", []))
                self._close(req, None)

    def _specs(self, req: _Request) -> list[tuple[_Request, RowSpec]]:
        job = req.job
        out = []
        for choice in range(job.choices):
            p, j = job.prompt_of(choice), choice % job.n
            params = job.params
            if params.seed is not None and j:
                params = dataclasses.replace(params, seed=(params.seed + j) % 2**64)
            inside = row_options(self.lm, job)
            out.append((req, RowSpec(p.ids, params, p.text, job.chat, req.on_step(choice), (req, choice), **inside,
                                     draft=job.draft, draft_tokens=job.draft_tokens or 4)))  # fmt: skip
        return out

    def _line_up(self, req: _Request) -> None:
        """The request's rows into the line for the batch (a model whose cache cannot take
        rows prefilled apart: its echo now, from a forward of its own)."""
        if req.job.echo and (not self.lane.reuse_kv or _own_prefill(req.job)):
            try:
                wanted = [(req, i) for i in range(len(req.job.prompts))]
                for (_, i), p in zip(wanted, self.lane.prefill(wanted, keep_kv=False).values()):
                    self.lane.announce(req, i, p)
            except BaseException as e:
                self._close(req, e)
                return
        self._rows.extend(self._specs(req))

    def _join(self, batch: ContinuousBatch) -> list[tuple[_Request, RowSpec]]:
        """Admits waiting rows: those with a prefill of their own join now, and the others too
        when no row decodes; the rest are returned, to be prefilled in the next step's forward."""
        if any(req.handle.cancelled for req, _ in self._rows):  # gone while waiting for room
            for req, _ in self._rows:
                if req.handle.cancelled:
                    self._close(req, Cancelled())
            self._rows = deque(item for item in self._rows if not item[0].closed)
        arriving = self._admit_rows(batch) if batch.free else []
        riding = [item for item in arriving if batch.rows and self.lane.reuse_kv and not _own_prefill(item[0].job)]
        now = [item for item in arriving if not any(item is r for r in riding)]
        if now:
            self._join_rows(batch, now, retry=True)
        self.peak_rows = max(self.peak_rows, len(batch.members))
        return riding

    def _joining(self, riding: list[tuple[_Request, RowSpec]]) -> Joining:
        """The rows' prompts prefilled in the batch's next step (lmtrace.decode.continuous):
        when that fails they are kept for a join of their own after the step."""

        def prefill(ride: Ride | None) -> tuple[list[RowSpec], list[Prefilled]] | None:
            wanted = [(req, spec.tag[1] // req.job.n) for req, spec in riding]
            try:
                found = self.lane.prefill(wanted, keep_kv=True, ride=ride)
                for req, i in wanted:
                    self.lane.announce(req, i, found[(id(req.handle), i)])
            except Exception:
                self._late = list(riding)
                return None
            return [s for _, s in riding], [found[(id(r.handle), i)] for r, i in wanted]

        return prefill

    def _admit_rows(self, batch: ContinuousBatch) -> list[tuple[_Request, RowSpec]]:
        """Admission: the waiting rows that join the batch now. Round-robin over the waiting
        requests in arrival order (one row of each in turn), so a request of thousands of rows
        does not hold back another's first row; a request holds at most `share` of the batch
        (room kept for a request that arrives while it runs)."""
        held = Counter(id(row.spec.tag[0]) for row in batch.members)
        share = self.max_batch - (max(1, self.max_batch // RESERVED_PART) if self.max_batch >= 4 else 0)
        lines: dict[int, deque[tuple[_Request, RowSpec]]] = {}
        for item in self._rows:
            if not item[0].closed:
                lines.setdefault(id(item[0]), deque()).append(item)
        taken: list[tuple[_Request, RowSpec]] = []
        free = batch.free
        while free and lines:
            for key in list(lines):
                if free and held[key] < share:
                    taken.append(lines[key].popleft())
                    held[key] += 1
                    free -= 1
                if not lines[key] or held[key] >= share:
                    del lines[key]
        chosen = {id(spec) for _, spec in taken}
        self._rows = deque(item for item in self._rows if id(item[1]) not in chosen and not item[0].closed)
        return taken

    def _join_rows(self, batch: ContinuousBatch, arriving: list[tuple[_Request, RowSpec]], retry: bool) -> None:
        """The rows that arrived together, prefilled together and joined; when that fails, one
        of them is at fault: each request alone, so the others still join."""
        own = [item for item in arriving if _own_prefill(item[0].job)]
        if own and len(own) < len(arriving):  # each group on its own way in
            self._join_rows(batch, own, retry)
            self._join_rows(batch, [item for item in arriving if not _own_prefill(item[0].job)], retry)
            return
        try:
            # a draft's own caches, the lens's and the attention's hooks: a prefill of their own
            if self.lane.reuse_kv and not own:
                wanted = [(req, spec.tag[1] // req.job.n) for req, spec in arriving]
                found = self.lane.prefill(wanted, keep_kv=True)
                for req, i in wanted:
                    self.lane.announce(req, i, found[(id(req.handle), i)])
                batch.join_prefilled([s for _, s in arriving], [found[(id(r.handle), i)] for r, i in wanted])
            else:
                batch.join_many([spec for _, spec in arriving])
        except BaseException as e:
            if not retry:
                self._close(arriving[0][0], e)
                return
            for req in dict.fromkeys(req for req, _ in arriving):
                if not req.closed:
                    self._join_rows(batch, [item for item in arriving if item[0] is req], retry=False)

    def _leave(self, row: RowState) -> None:
        req, choice = row.spec.tag
        if req.closed:
            return
        if row.error is not None:
            self._close(req, row.error)
            return
        req.traces[choice] = row.trace
        req.left -= 1
        if req.left == 0:
            req.handle.emit(("done", req.traces))
            self._close(req, None)

    def _close(self, req: _Request, error: BaseException | None) -> None:
        """Ends the request once: its error (if any), the end event, its admission slot."""
        if req.closed:
            return
        req.closed = True
        handle = req.handle
        if isinstance(error, Cancelled):
            self.cancelled += 1
            if handle.server_stopping:  # the client is still there: it is told why its answer stops
                handle.emit(("error", ShuttingDown()))
        elif error is not None:
            handle.emit(("error", error))
        else:
            self.finished += 1
        self._durations.append(time.perf_counter() - req.started)
        self.end(handle)

    def shutdown(self) -> None:
        """Stops the model thread at its next step; what was still running is cancelled."""
        with self._lock:
            live = list(self._live)
        for handle in live:
            handle.cancel()
        with self._wake:
            self._stopped = True
            self._wake.notify()


def _own_prefill(job: Job) -> bool:
    """Rows that join the batch with a prefill of their own: a draft (its own caches), the lens,
    the attention or the attribution (their hooks watch the prefill)."""
    return job.draft is not None or any(job.inside.get(k) for k in ("lens", "attention", "attribution"))
