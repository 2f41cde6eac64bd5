"""schemathesis against a fresh `lmtrace serve` of the bundled model, pointed at nothing but its
/openapi.json: no answer >= 500, every answer's status, headers, content type and body as the
document says, no request valid by the document refused, none that breaks it accepted. Two
bounded runs (2 examples an operation): the positive cases through tests/server/st_hooks.py (which
lowers max_tokens to 2 and leaves out the fields whose validity is a language of its own; the
coverage phase takes no hooks, so this run has the other three phases), the negative cases in
every default phase."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.process import SRC

pytestmark = pytest.mark.integration
pytest.importorskip("schemathesis")
ROOT = Path(__file__).resolve().parents[2]
# the positive run (every operation with schema-valid bodies, minutes on 2 cores) is `slow`: `make test-slow`
RUNS = [pytest.param("positive", "examples,fuzzing,stateful", "tests.server.st_hooks", marks=pytest.mark.slow,
                     id="positive"),
        pytest.param("negative", "examples,coverage,fuzzing,stateful", None, id="negative")]  # fmt: skip


@pytest.mark.parametrize(("mode", "phases", "hooks"), RUNS)
def test_schemathesis_finds_nothing(bundled_server, mode, phases, hooks):
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{SRC}"}
    if hooks:
        env["SCHEMATHESIS_HOOKS"] = hooks
    cmd = [st, "run", f"{bundled_server}/openapi.json", "--mode", mode, "--phases", phases, "-n", "2",
           "--seed", "1", "--request-timeout", "120", "--no-color"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failure" not in run.stdout.split("SUMMARY")[-1].lower()
