"""Running the app on uvicorn with a shutdown of lmtrace's own. uvicorn runs in a thread;
the main thread takes SIGTERM and SIGINT: the server stops taking connections, requests in
flight get `shutdown_timeout` seconds to finish, then the ones still generating are cancelled
(503, or a last error event in a stream), and the process exits 0. A second signal cancels
at once. (uvicorn's own handling would wait for every generation however long, then kill the
process with the signal it caught.)"""

from __future__ import annotations

import signal
import threading
import time

import uvicorn
from fastapi import FastAPI

from lmtrace.errors import LmtraceError

SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.1


class ServeError(LmtraceError):
    """The server could not start (the port is taken, the address is not this machine's)."""


class Runner:
    def __init__(self, app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str = "info"):
        self.worker = app.state.lmtrace.worker
        self.timeout = shutdown_timeout
        # uvicorn's own limit is a backstop, for a connection that never closes
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(shutdown_timeout) + 5
        )
        self.server = uvicorn.Server(config)
        self.deadline: float | None = None  # when requests in flight are cancelled

    def stop(self, signum: int | None = None, frame: object = None) -> None:
        """The signal handler (also callable directly): a first call starts the shutdown, a
        second one cancels what is still running."""
        now = time.monotonic()
        self.deadline = now if self.deadline is not None else now + self.timeout
        self.server.should_exit = True

    def run(self) -> None:
        thread = threading.Thread(target=self.server.run, name="uvicorn")
        previous = {sig: signal.signal(sig, self.stop) for sig in SIGNALS}
        try:
            thread.start()
            while thread.is_alive():
                thread.join(POLL_S)
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self.worker.drain()  # again at every poll: also what was admitted meanwhile
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not self.server.started:  # uvicorn logged why (and exited its thread)
            raise ServeError(f"the server could not start on {self.server.config.host}:{self.server.config.port}")
