"""The CLI in-process: exit codes, one-line errors, JSON output, prompt sources."""

from __future__ import annotations

import io
import json
import types

import pytest

from lmtrace.cli import main

BAD = [
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--min-p", "2"], "min_p must be in [0, 1], got 2.0"),
    (["--top-k", "-3"], "top_k must be >= 0, got -3"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0, got 0.0"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--top-p", "inf"], "top_p must be a finite number, got inf"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--top-logprobs", "101"], "top_logprobs must be in [0, 100], got 101"),
    (["--temperature", "warm"], "Invalid value for '--temperature': 'warm' is not a valid float."),
    (["--device", "tpu"], "device must be one of auto, cpu, cuda, mps, got 'tpu'"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_exit_2_with_one_line(capsys, tiny_dir, args, message):
    code = main(["generate", "Hello", "--model", str(tiny_dir), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"lmtrace: error: {message}\n"


def test_prompt_too_long_for_the_context(capsys, tiny_dir):
    code = main(["generate", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "300", "--no-color"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and [line for line in err if "error" in line] == err[-1:]  # after the startup lines
    assert "max_new_tokens must fit the context" in err[-1] and "300" in err[-1]


def test_missing_model_exit_2(capsys, tmp_path):
    code = main(["generate", "Hello", "--model", str(tmp_path / "nope")])
    assert code == 2
    assert capsys.readouterr().err.startswith("lmtrace: error: model: no such file or folder")


def test_generate_writes_json_atomically_and_shows_the_table(capsys, tiny_dir, tmp_path):
    out = tmp_path / "trace.json"
    code = main(
        [
            "generate",
            "Hello world",
            "--model",
            str(tiny_dir),
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--top-logprobs",
            "3",
            "--json",
            str(out),
            "--no-color",
        ]
    )
    assert code == 0
    d = json.loads(out.read_text())
    assert len(d["steps"]) == 6 and len(d["steps"][0]["top"]) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary file left behind
    shown = " ".join(capsys.readouterr().out.split())  # the header wraps under itself at 80 columns
    for word in ("prob", "rank", "entropy", "alternatives", "greedy", "finish: length"):
        assert word in shown


def test_json_to_stdout_is_pure_json(capsys, tiny_dir):
    code = main(
        ["generate", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "3", "--temperature", "0", "--json", "-"]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert json.loads(captured.out)["schema_version"] == 1
    assert "entropy" in captured.err  # the view goes to stderr


def test_prompt_from_file_and_from_stdin(capsys, tiny_dir, tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("Once upon")
    assert (
        main(
            [
                "generate",
                "--prompt-file",
                str(f),
                "--model",
                str(tiny_dir),
                "--max-new-tokens",
                "2",
                "--temperature",
                "0",
                "--json",
                "-",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["prompt"]["text"] == "Once upon"
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert (
        main(["generate", "--model", str(tiny_dir), "--max-new-tokens", "2", "--temperature", "0", "--json", "-"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["prompt"]["text"] == "from stdin"


def test_unreadable_prompt_file(capsys, tmp_path):
    assert main(["generate", "--prompt-file", str(tmp_path / "none.txt")]) == 2
    assert "prompt-file: cannot read" in capsys.readouterr().err


def test_help_is_complete(capsys):
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert main(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    for opt in (
        "--model",
        "--device",
        "--dtype",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repetition-penalty",
        "--seed",
        "--stop",
        "--chat",
        "--top-logprobs",
        "--json",
        "--no-color",
        "--prompt-file",
    ):
        assert opt in text


def test_the_gguf_loader_bar_is_silenced_while_the_cli_loads():
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from lmtrace.cli.common import no_gguf_bar

    bar = gguf_utils.tqdm
    with no_gguf_bar():  # lmtrace's own progress line (after 2 s) in place of the plain tqdm bar
        tensors = [types.SimpleNamespace(n_bytes=8) for _ in range(3)]  # as gguf's reader lists them
        assert gguf_utils.tqdm is not bar and list(gguf_utils.tqdm(tensors)) == tensors
    assert gguf_utils.tqdm is bar and not gguf_utils.tqdm(range(3), file=io.StringIO()).disable
