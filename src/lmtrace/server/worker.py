"""The model runs in one worker thread, one generation at a time, so the event loop stays free
to answer other requests. A bounded number of requests are admitted (running or waiting);
beyond that `submit` raises Busy (HTTP 429). A request whose client left is cancelled: its
generation stops at the next step and the model moves on to the next request."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from starlette.requests import Request

Event = tuple[Any, ...]
Emit = Callable[[Event], None]
# work(emit, check): runs on the model thread; emit() sends an event to the request,
# check() raises Cancelled once the request has been cancelled.
Work = Callable[[Emit, Callable[[], None]], None]

END = ("end",)
DISCONNECT_POLL_S = 0.25


class Busy(Exception):
    """Every admission slot is taken; `retry_after` is a guess in whole seconds."""

    def __init__(self, limit: int, retry_after: int):
        super().__init__(f"the server is busy: {limit} requests are already running or waiting")
        self.limit, self.retry_after = limit, retry_after


class Cancelled(Exception):
    """Raised on the model thread to stop the generation of a cancelled request."""


class ShuttingDown(Exception):
    """What a request cancelled by the server's shutdown gets instead of its answer (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: this request was cancelled before it finished")


class Handle:
    """One admitted request: its events arrive on an asyncio queue, fed from the model thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop  # the request's event loop (callbacks from the model thread go through it)
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.server_stopping = False  # cancelled because the server stops, not because the client left

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutting down): nobody listens
            pass

    def check(self) -> None:
        if self._cancelled.is_set():
            raise Cancelled

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def events(self, request: Request | None = None) -> AsyncIterator[Event]:
        """Events until the work ends; an error raised by the work is raised here. Polls the
        client while waiting, and cancels the work if it has gone."""
        checked = time.monotonic()
        while True:
            try:
                event: Event | None = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            # every so often, also while steps keep arriving
            if request is not None and time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.cancel()
                    return
            if event is None:
                continue
            if event is END:
                return
            if event[0] == "error":
                raise event[1]
            yield event


class ModelWorker:
    """Admits at most `limit` requests at once and runs their work on a single thread."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {limit}")
        self.limit = limit
        self.admitted = 0  # changed under the lock, on the event loop (admission) and the model thread
        self.finished = 0
        self.cancelled = 0
        self._durations: deque[float] = deque(maxlen=16)
        self._live: set[Handle] = set()
        self._lock = threading.Lock()  # _live changes on the event loop and the model thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmtrace-model")

    def submit(self, work: Work) -> Handle:
        """Queues the work (call from the event loop); raises Busy when every slot is taken."""
        handle = self._admit()
        future = self._pool.submit(self._run, handle, work)
        future.add_done_callback(lambda f: self._dropped(handle, f))
        return handle

    def _admit(self) -> Handle:
        """A slot for one request (call from the event loop), or Busy when every slot is taken."""
        with self._lock:
            if self.admitted >= self.limit:
                raise Busy(self.limit, self.retry_after())
            handle = Handle(asyncio.get_running_loop())
            self.admitted += 1
            self._live.add(handle)
        return handle

    def _dropped(self, handle: Handle, future: Future) -> None:
        """Ends a work dropped at shutdown before it ran (one that ran ended itself in `_run`)."""
        if future.cancelled():
            self.end(handle)

    def end(self, handle: Handle) -> None:
        """Frees the request's slot, then tells the request its answer is complete, in that
        order: a client that sends its next request as soon as it has the answer finds the slot
        free (the other order answered it 429 now and then). The slot frees when the model
        thread is done with the work, not when the client leaves; directly, not through the
        request's event loop, which may be gone by then (a test client's loop lives only as long
        as its request)."""
        with self._lock:
            self._live.discard(handle)
            self.admitted -= 1
        handle.emit(END)

    def _run(self, handle: Handle, work: Work) -> None:
        started = time.perf_counter()
        try:
            handle.check()
            work(handle.emit, handle.check)
            self.finished += 1
        except Cancelled:
            self.cancelled += 1
            if handle.server_stopping:  # the client is still there: it is told why its answer stops
                handle.emit(("error", ShuttingDown()))
        except BaseException as e:  # handed to the request, which answers with the envelope
            handle.emit(("error", e))
        finally:
            self._durations.append(time.perf_counter() - started)
            self.end(handle)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the typical request time times the line ahead."""
        typical = sorted(self._durations)[len(self._durations) // 2] if self._durations else 1.0
        return max(1, math.ceil(typical * max(1, self.admitted)))

    def drain(self) -> None:
        """Cancels every admitted request, running or waiting, because the server stops: each
        stops at its next step and answers 503 (or ends its stream with that error)."""
        with self._lock:  # called from another thread than the event loop's (a signal handler's)
            live = list(self._live)
        for handle in live:
            handle.server_stopping = True
            handle.cancel()

    def shutdown(self) -> None:
        """Drops the waiting work and stops the running generation at its next step."""
        with self._lock:
            live = list(self._live)
        for handle in live:
            handle.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
