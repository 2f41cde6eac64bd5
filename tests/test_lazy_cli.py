"""`lmtrace --help` and argument errors never import torch or transformers (they take seconds):
measured by the modules a fresh interpreter holds afterwards, not by timing."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "numpy", "safetensors", "lmtrace.model.load", "lmtrace.decode.engine")
COMMANDS = ("generate", "score", "cache", "kv-size", "verify", "branch", "render", "serve", "batch", "compare",
            "export", "kv-lab", "stability")  # fmt: skip
ARGVS = [
    ["--help"],
    ["--version"],
    *[[c, "--help"] for c in COMMANDS],
    ["generate", "Hi", "--temperature", "-1"],  # a value error from SamplingParams
    ["generate", "Hi", "--max-new-tokens", "many"],  # a click type error
    ["no-such-command"],
    ["batch", "in.jsonl", "-"],
    ["export"],  # OUT_DIR missing
    ["generate", "Hi", "--waterfall", "x"],  # value errors checked before the model is loaded
    ["generate", "Hi", "--dtype", "float7"],
    ["score", "some text", "--device", "tpu"],
    ["branch", "Hi", "--at", "-1"],
    ["verify", "Hi", "--max-new-tokens", "0"],
    ["serve", "--port", "0"],
    ["stability", "Hi", "--variant", "fp8"],  # variant specs checked before the model is loaded
    ["stability", "Hi", "--variant", "model:/no/such/file.gguf"],
]
CHILD = """
import contextlib, io, json, sys
from lmtrace.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes.append(main(argv))
heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_help_and_argument_errors_import_no_torch():
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(ARGVS), json.dumps(HEAVY)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["heavy"] == []
    assert result["codes"] == [0, 0, *[0] * len(COMMANDS), *[2] * (len(ARGVS) - 2 - len(COMMANDS))]


def test_import_lmtrace_is_light_and_the_api_still_resolves():
    code = (
        "import sys, lmtrace; light = 'torch' not in sys.modules; "
        "import lmtrace.scoring.score, lmtrace.decode.branch; "  # modules named as public functions
        "print(light, callable(lmtrace.score), callable(lmtrace.branch), lmtrace.load.__module__, "
        "lmtrace.model.load.__name__, sorted(lmtrace.__all__) == sorted(set(lmtrace.__all__)))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    expected = ["True", "True", "True", "lmtrace.model.load", "lmtrace.model.load", "True"]
    assert run.stdout.split() == expected, run.stderr
