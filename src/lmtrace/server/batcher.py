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
from collections import deque
from typing import TYPE_CHECKING, Any

from lmtrace.decode.continuous import ContinuousBatch, Row, RowSpec
from lmtrace.model.lm import LM
from lmtrace.records import Step, Trace
from lmtrace.server.logprobs import prompt_logprobs
from lmtrace.server.worker import END, Cancelled, Handle, ModelWorker, ShuttingDown, Work

if TYPE_CHECKING:
    from lmtrace.server.prepare import Job

IDLE_WAIT_S = 0.5


class _Request:
    """An admitted request on the model thread: its rows' traces as they finish."""

    def __init__(self, handle: Handle, job: Job, loop: asyncio.AbstractEventLoop):
        self.handle, self.job, self.loop = handle, job, loop
        self.traces: list[Trace | None] = [None] * job.choices
        self.left = job.choices
        self.closed = False
        self.started = time.perf_counter()

    def on_step(self, choice: int):
        def hook(step: Step) -> None:
            if self.closed or self.handle.cancelled:
                raise Cancelled
            self.handle.emit(("step", choice, step))

        return hook


class BatchingWorker(ModelWorker):
    """Admits at most `limit` requests; decodes up to `max_batch` rows together."""

    def __init__(self, lm: LM, limit: int, max_batch: int):
        super().__init__(limit)
        self.lm, self.max_batch = lm, max_batch
        self._waiting: deque[_Request] = deque()
        self._rows: deque[tuple[_Request, RowSpec]] = deque()  # admitted, not yet in the batch
        # whole works that need the model to themselves (lens / attention swap its attention
        # function): run on the model thread between two steps of the batch, never beside it
        self._exclusive: deque[tuple[Handle, Work]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.peak_rows = 0  # the most rows decoded together so far (for tests and the bench)

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
            self._run(handle, work)  # emits the work's events and its end
        else:  # dropped at shutdown before it ran
            handle.emit(END)
        with self._lock:
            self._live.discard(handle)
        try:
            handle.loop.call_soon_threadsafe(self._release)
        except RuntimeError:
            pass

    def _loop(self) -> None:
        batch = ContinuousBatch(self.lm, self.max_batch)
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
            for req in arrived:
                self._open(req)
            self._join(batch)
            if batch.empty:
                continue
            try:
                gone = batch.step()
            except BaseException as e:  # the forward pass failed: every row in it fails
                for row in batch.rows:
                    self._close(row.spec.tag[0], e)
                batch = ContinuousBatch(self.lm, self.max_batch)
                continue
            for row in gone:
                self._leave(row)
        for req in [*self._waiting, *(r for r, _ in self._rows), *(row.spec.tag[0] for row in batch.rows)]:
            self._close(req, Cancelled())
        for handle, work in list(self._exclusive):
            self._run_exclusive(handle, work, run=False)

    def _open(self, req: _Request) -> None:
        """Echo's prompt logprobs, then the request's rows into the line for the batch."""
        job = req.job
        try:
            req.handle.check()
            if job.echo:
                for i, p in enumerate(job.prompts):
                    req.handle.emit(("prompt", i, prompt_logprobs(self.lm, p.ids, job.top_n if job.logprobs else 0)))
            if not job.generate:
                req.handle.emit(("done", []))
                self._close(req, None)
                return
        except BaseException as e:
            self._close(req, e)
            return
        for choice in range(job.choices):
            p, j = job.prompt_of(choice), choice % job.n
            params = job.params
            if params.seed is not None and j:
                params = dataclasses.replace(params, seed=(params.seed + j) % 2**64)
            spec = RowSpec(p.ids, params, p.text, job.chat, req.on_step(choice), (req, choice))
            self._rows.append((req, spec))

    def _join(self, batch: ContinuousBatch) -> None:
        if any(req.handle.cancelled for req, _ in self._rows):  # gone while waiting for room
            for req, _ in self._rows:
                if req.handle.cancelled:
                    self._close(req, Cancelled())
            self._rows = deque(item for item in self._rows if not item[0].closed)
        arriving = []
        while self._rows and len(arriving) < batch.free:
            req, spec = self._rows.popleft()
            if not req.closed:
                arriving.append((req, spec))
        try:  # the rows that arrived together are prefilled in one forward
            batch.join_many([spec for _, spec in arriving])
        except BaseException:  # one of them is at fault: each alone, so the others still join
            for req, spec in arriving:
                try:
                    batch.join(spec)
                except BaseException as e:
                    self._close(req, e)
        self.peak_rows = max(self.peak_rows, len(batch.rows))

    def _leave(self, row: Row) -> None:
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
        handle.emit(END)
        with self._lock:
            self._live.discard(handle)
        try:
            req.loop.call_soon_threadsafe(self._release)
        except RuntimeError:
            pass

    def shutdown(self) -> None:
        """Stops the model thread at its next step; what was still running is cancelled."""
        with self._lock:
            live = list(self._live)
        for handle in live:
            handle.cancel()
        with self._wake:
            self._stopped = True
            self._wake.notify()
