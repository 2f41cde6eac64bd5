"""A batch job really killed part-way (SIGKILL of the process) resumes to the complete output:
every id once, equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lmtrace
from lmtrace.cli import main
from tests.same_record import assert_same, by_id, one_thread, read_records  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = ["--temperature", "0", "--max-new-tokens", "48", "--top-logprobs", "2", "--batch-size", "2"]
WORDS = "Hello world the quick brown fox jumps over the lazy dog once upon a time".split()


def _complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _child_env() -> dict[str, str]:
    """The child imports the lmtrace under test (this checkout), offline."""
    src = str(Path(lmtrace.__file__).resolve().parents[1])
    path = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_killed_job_resumes_to_the_uninterrupted_output(tiny_dir, tmp_path):
    lines = [{"id": f"p{i}", "prompt": " ".join(WORDS[i % 7 : i % 7 + 1 + i % 5])} for i in range(40)]
    lines[5]["temperature"] = -1  # an error line among them
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "lmtrace.cli", "batch", str(src), str(out), "--model", str(tiny_dir), *SETTINGS]
    child = subprocess.Popen(cmd, env=_child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _complete_lines(out) < 6 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, f"the job ended before it was killed: {err.decode()[-500:]}"
    written = _complete_lines(out)
    assert 6 <= written < len(lines)

    assert main(["batch", str(src), str(out), "--model", str(tiny_dir), *SETTINGS]) == 0  # resume
    resumed = by_id(read_records(out))  # each id once
    assert len(read_records(out)) == len(lines)

    whole = tmp_path / "whole.jsonl"
    assert main(["batch", str(src), str(whole), "--model", str(tiny_dir), *SETTINGS]) == 0
    assert_same(resumed, by_id(read_records(whole)))
    assert "error" in resumed["p5"]
