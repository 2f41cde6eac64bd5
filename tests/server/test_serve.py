"""`lmtrace serve`: options, loopback by default, and the real command serving over HTTP."""

from __future__ import annotations

import signal
import socket
import subprocess

import httpx
import pytest

from lmtrace.cli import main
from lmtrace.cli.serve import is_loopback
from tests.server.process import free_port, start_serve


@pytest.fixture
def fake_uvicorn(monkeypatch):
    calls = []

    def run(runner):
        config = runner.server.config
        calls.append((config.app, {"host": config.host, "port": config.port, "shutdown_timeout": runner.timeout}))

    monkeypatch.setattr("lmtrace.server.run.Runner.run", run)
    return calls


def test_loopback_by_default(capsys, tiny_dir, fake_uvicorn):
    assert main(["serve", "--model", str(tiny_dir)]) == 0
    ((app, kw),) = fake_uvicorn
    assert kw["host"] == "127.0.0.1" and kw["port"] == 8000
    assert app.state.lmtrace.name == tiny_dir.name and app.state.lmtrace.worker.limit == 16
    assert "warning" not in capsys.readouterr().err


def test_another_host_without_a_key_warns(capsys, tiny_dir, fake_uvicorn):
    assert main(["serve", "--model", str(tiny_dir), "--host", "0.0.0.0", "--max-concurrency", "3"]) == 0
    err = capsys.readouterr().err
    assert "lmtrace: warning: serving on 0.0.0.0 without --api-key" in err
    assert fake_uvicorn[0][0].state.lmtrace.worker.limit == 3
    assert main(["serve", "--model", str(tiny_dir), "--host", "0.0.0.0", "--api-key", "k"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "0"], "port must be in [1, 65535], got 0"),
        (["--max-concurrency", "0"], "max_concurrency must be >= 1, got 0"),
        (["--api-key", " "], "api_key must not be empty"),
        (["--shutdown-timeout", "-1"], "shutdown_timeout must be in [0, 3600] seconds, got -1.0"),
    ],
)
def test_bad_options_exit_2_before_loading(capsys, fake_uvicorn, args, message):
    assert main(["serve", "--model", "/nonexistent/model", *args]) == 2
    assert capsys.readouterr().err == f"lmtrace: error: {message}\n"
    assert not fake_uvicorn


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.com")


def outward_address() -> str | None:
    """This machine's address on its network (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_the_real_command_serves_on_loopback_only(tiny_dir):
    port = free_port()
    proc, url = start_serve(tiny_dir, port)
    try:
        body = {"model": tiny_dir.name, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 1}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 3
        other = outward_address()
        if other is not None:
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=2).close()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
