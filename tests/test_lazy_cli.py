"""`lmtrace --help` and argument errors never import torch or transformers (they take seconds):
measured by the modules a fresh interpreter holds afterwards, not by timing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

HEAVY = ("torch", "transformers", "numpy", "safetensors", "lmtrace.model.load", "lmtrace.decode.engine")
COMMANDS = ("generate", "score", "cache", "kv-size", "verify", "branch", "render", "serve", "batch", "compare",
            "export", "kv-lab", "audit", "stability", "sample", "intervene", "steer-vector")  # fmt: skip
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
    ["audit", "http://127.0.0.1:9", "--probe", "nope"],  # checked before the model loads
    ["audit", "http://127.0.0.1:9"],  # nothing listens there: said before torch is imported
    ["generate", "Hi", "--regex", "a", "--choice", "x", "--choice", "y"],  # two constraints
    ["generate", "Hi", "--json-schema", "no-such-schema.json"],
    ["sample", "Hi", "-n", "0"],  # sample's settings checked before the model loads
    ["sample", "Hi", "--warmup", "2"],
    ["generate", "Hi", "--uncertainty", "--confidence-window", "0"],
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
        "import lmtrace.scoring.teacher.score, lmtrace.decode.branch; "  # modules named as public functions
        "print(light, callable(lmtrace.score), callable(lmtrace.branch), lmtrace.load.__module__, "
        "lmtrace.model.load.__name__, sorted(lmtrace.__all__) == sorted(set(lmtrace.__all__)))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    expected = ["True", "True", "True", "lmtrace.model.load", "lmtrace.model.load", "True"]
    assert run.stdout.split() == expected, run.stderr


FILE_ERRORS = """
import contextlib, io, json, os, sys, time
from lmtrace.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    out.append([code, err.getvalue(), time.perf_counter() - started])
print(json.dumps({"runs": out, "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}))
"""


def test_file_and_model_errors_are_answered_before_torch(tmp_path):
    """A binary or missing prompt file, a missing model path, an empty prompt, a hub id missing
    from the local cache while offline: exit 2, one line naming the option, torch never imported."""
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"Hello \xd0\xff\xfe\x00\x01")
    argvs = [
        (["generate", "--prompt-file", str(binary)],
         f"prompt-file: '{binary}' is not UTF-8 text (byte 0xd0 at offset 6)"),
        (["generate", "--prompt-file", str(tmp_path / "none.txt")], "prompt-file: cannot read"),
        (["generate", "Hi", "--model", str(tmp_path / "no-model")],
         f"model: no such file or folder: '{tmp_path}/no-model'"),
        (["generate", ""], "prompt: PROMPT is empty"),
        (["score", "--file", str(binary)], "file: "),
        (["cache", "", "--max-new-tokens", "2"], "prompt: PROMPT is empty"),
        (["branch", "Hi", "--at", "0", "--model", "someone/not-cached"],
         "model: 'someone/not-cached' is not in the local Hugging Face cache"),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run([sys.executable, "-c", FILE_ERRORS, json.dumps([a for a, _ in argvs])], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["heavy"] == []
    for (argv, message), (code, err, _) in zip(argvs, result["runs"]):
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"lmtrace: error: {message}"), (argv, err)
    assert err.rstrip().endswith("pass a local folder or .gguf file.")  # a whole sentence


FIRST_LINE = """
import io, json, sys
class Spy(io.StringIO):
    first = None
    def write(self, text):
        if self.first is None and text.strip():
            Spy.first = [text.strip(), "torch" in sys.modules]
        return super().write(text)
sys.stderr = spy = Spy()
from lmtrace.cli import main
code = main(["generate", "Hi", "--model", sys.argv[1], "--max-new-tokens", "1", "--no-color"])
print(json.dumps({"code": code, "first": Spy.first, "err": spy.getvalue()}))
"""


def test_the_first_line_comes_before_torch_and_the_last_says_the_times(tiny_dir):
    run = subprocess.run([sys.executable, "-c", FIRST_LINE, str(tiny_dir)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])  # after the view, on stdout
    assert result["code"] == 0
    assert result["first"] == [f"{tiny_dir.name}: loading (importing torch and transformers)…", False]
    ready = [line for line in result["err"].splitlines() if " ready in " in line]
    assert len(ready) == 1 and re.fullmatch(
        rf"{tiny_dir.name} ready in \d+\.\d s: imports \d+\.\d s, weights \d+\.\d s", ready[0]
    ), result["err"]
    assert str(tiny_dir.parent) not in result["err"]  # the model's folder path only with --verbose
