"""`--batch-invariant` on the CLI, in-process on the tiny model: generate names the mode in the
trace's model.config; rollouts of an invariant generate teacher-force to bitwise_equal; stability's
batch variant measures 0.0 in the mode; what cannot be invariant is one line naming both, exit 2."""

from __future__ import annotations

import json

import pytest

from lmtrace.cli import main


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_then_rollouts_bitwise_equal(capsys, tiny_dir, tmp_path):
    trace_path, report_path = tmp_path / "t.json", tmp_path / "r.json"
    code, _, err = run(capsys, "generate", "Hello world", "--model", tiny_dir, "--batch-invariant", "--temperature",
                       0.7, "--seed", 4, "--max-new-tokens", 8, "--json", trace_path, "--no-color")  # fmt: skip
    assert code == 0, err
    trace = json.loads(trace_path.read_text())
    assert trace["model"]["config"]["batch_invariant"] is True
    line = {"id": "a", "prompt_ids": trace["prompt"]["token_ids"], "sampling": {"temperature": 0.7},
            "completion_ids": [s["token_id"] for s in trace["steps"]],
            "logprobs": [s["sampled_logprob"] for s in trace["steps"]]}  # fmt: skip
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text(json.dumps(line) + "\n")
    code, out, err = run(capsys, "rollouts", rollouts, "--model", tiny_dir, "--batch-invariant", "--json",
                         report_path, "--no-color")  # fmt: skip
    assert code == 0, err
    summary = json.loads(report_path.read_text())["summary"]
    assert summary["bitwise_equal"] is True and summary["mean_abs_delta"] == 0.0
    assert "Bitwise equal" in out


def test_stability_batch_variant_measures_zero(capsys, tiny_dir, tmp_path):
    path = tmp_path / "s.json"
    code, _, err = run(capsys, "stability", "Hello world", "--model", tiny_dir, "--batch-invariant", "--variant",
                       "batch:4", "--max-new-tokens", 6, "--json", path, "--no-color")  # fmt: skip
    assert code == 0, err
    (variant,) = json.loads(path.read_text())["variants"]
    assert variant["max_abs_delta"] == 0.0


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["batch", "IN", "OUT", "--engine", "vllm"], "batch_invariant: --batch-invariant runs lmtrace's own engine"),
        (["generate", "x", "--matmul", "onednn"], "batch_invariant and matmul 'onednn'"),
        (["generate", "x", "--compile"], "compile: --compile chooses its own kernels; not with --batch-invariant"),
        (["score", "x", "--server", "http://127.0.0.1:9"], "server: --batch-invariant is the server's own option"),
    ],
)
def test_refusals_name_both_options(capsys, tiny_dir, tmp_path, args, line):
    if args[0] == "batch":
        (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
        args = ["batch", tmp_path / "in.jsonl", tmp_path / "out.jsonl", *args[3:]]
    code, _, err = run(capsys, *args, "--model", tiny_dir, "--batch-invariant")
    assert code == 2
    errors = [e for e in err.splitlines() if e.startswith("lmtrace: error:")]
    assert len(errors) == 1 and line in errors[0] and "Traceback" not in err
