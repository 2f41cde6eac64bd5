"""`lmtrace serve` as a real separate process on a free loopback port, for the tests that need
the command itself (signals, what it binds to)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(model_dir: Path, port: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """Starts `lmtrace serve` and waits (up to 90 s) until /health answers; (process, base url)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", "from lmtrace.cli import entry; entry()", "serve", "--model", str(model_dir)]
    proc = subprocess.Popen([*cmd, "--port", str(port), *extra], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("lmtrace serve did not start")
        time.sleep(0.2)
