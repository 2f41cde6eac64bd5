"""The README's Python examples run as written, in order, on the bundled model, and none of them
triggers a deprecation warning (transformers 5.24 warns on `past_key_values=`: the examples say
`cache=`). Warnings that upstream code raises while transformers imports are not the examples'."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[1] / "README.md"
SRC = str(Path(__file__).resolve().parents[1] / "src")
# raised by torch while transformers imports, whatever the examples do
UPSTREAM = ("`torch.jit.script_method` is deprecated",)
# what the prose before the first two examples has defined by then
PREAMBLE = "import lmtrace, torch\nlm = lmtrace.load()\ntrace = lmtrace.generate(lm, 'Hello', max_new_tokens=4)\n"
RUNNER = """
import json, sys, warnings
source = open(sys.argv[1], encoding="utf-8").read()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(compile(source, "README.md", "exec"), {"__name__": "__main__"})
kinds = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
print(json.dumps([f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, kinds)]))
"""


def examples() -> str:
    return PREAMBLE + "\n".join(re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S))


def test_the_examples_use_cache_not_past_key_values():
    assert "past_key_values=" not in examples() and "out.past_key_values" not in examples()


def test_the_readme_examples_run_without_deprecation_warnings(tmp_path):
    script = tmp_path / "readme.py"
    script.write_text(examples(), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", RUNNER, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = [w for w in json.loads(done.stdout.strip().splitlines()[-1]) if not any(u in w for u in UPSTREAM)]
    assert found == [], found
    assert (tmp_path / "loop.html").is_file() and (tmp_path / "report.html").is_file()
