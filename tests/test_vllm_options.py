"""`lmtrace batch --engine vllm`'s bad input, said in one line with exit code 2 before any model
loads; these need no vLLM (one test hides it to check what a user without it is told)."""

from __future__ import annotations

import sys

import pytest

from lmtrace.cli import main


@pytest.fixture
def job(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "Hello"}\n')
    return [str(src), str(tmp_path / "out.jsonl")]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--engine", "vllm", "--device-map", "auto"], "device_map: not with --engine vllm"),
        (["--engine", "local", "--tensor-parallel-size", "2"], "tensor_parallel_size: only with --engine vllm"),
        (["--engine", "ray", "--logprobs-mode", "processed"], "logprobs_mode: only with --engine vllm"),
        (["--logits-processor", "nope"], "logits_processor: expected NAME=module:function"),
        (["--logits-processor", "a=tests.nowhere:f"], "logits_processor: cannot import 'tests.nowhere:f'"),
        (["--engine", "vllm", "--kv-cache-gib", "0"], "kv_cache_gib must be > 0"),
        (["--engine", "vllm", "--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
        (["--engine", "vllm", "--logprobs-mode", "both"], "Invalid value for '--logprobs-mode'"),
    ],
)
def test_bad_options(job, capsys, args, named):
    assert main(["batch", *job, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


def test_without_vllm(job, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails as if not installed
    assert main(["batch", *job, "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--engine vllm needs vLLM" in err[0] and "lmtrace[vllm]" in err[0], err
