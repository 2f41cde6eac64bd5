"""bench/cuda_check.py, the maintainer's GPU check, runs end to end here on the CPU on a tiny
model of the real vocabulary with fastapi, uvicorn and gguf unimportable (the GPU machine has
none of them), every check passing; with --device cuda and no GPU it is skipped, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = "import sys\nfor m in ('fastapi', 'uvicorn', 'gguf'):\n    sys.modules[m] = None\n"


def run(args: list[str]) -> subprocess.CompletedProcess:
    script = str(ROOT / "bench" / "cuda_check.py")
    script = str(ROOT / "bench" / "cuda_check.py")
    code = BLOCKED + f"import runpy\nsys.argv = ['cuda_check', *{args!r}]\n"
    code += f"runpy.run_path({script!r}, run_name='__main__')\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_cuda_check_runs_on_the_cpu_without_server_or_gguf(tmp_path):
    out = tmp_path / "c.json"
    done = run(["--device", "cpu", "--tiny", "--tokens", "6", "--batch", "2", "--out", str(out)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    names = [(c["dtype"], c["check"]) for c in report["checks"]]
    assert names == [(d, c) for d in ("float32", "bfloat16") for c in ("greedy", "kv", "lens_attention", "batched")]
    assert all(c["passed"] for c in report["checks"]) and report["passed"]
    greedy = report["checks"][0]["figures"]
    assert greedy["ids_equal"] and greedy["max_abs_delta"] <= 1e-5 and greedy["lmtrace_tok_s"] > 0
    assert "all checks passed" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check runs rather than skips")
def test_cuda_check_is_skipped_without_a_gpu(tmp_path):
    out = tmp_path / "c.json"
    done = run(["--out", str(out)])
    assert done.returncode == 0 and "skipped: no CUDA device" in done.stdout
    assert json.loads(out.read_text())["skipped"].startswith("no CUDA device")
