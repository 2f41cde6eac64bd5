"""The CLI of score, score --jsonl, branch, and generate --echo / --waterfall, in-process."""

from __future__ import annotations

import json

import pytest

import lmtrace
from lmtrace.cli import main
from tests.cli_errors import one_error


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_score_text_to_a_json_file(capsys, tiny_dir, tiny_lm, tmp_path):
    path = tmp_path / "score.json"
    code, out, _ = run(capsys, "score", "Hello world, the quick brown fox", "--model", tiny_dir, "--json", path)
    assert code == 0
    d = json.loads(path.read_text())
    assert d["tokens"][0]["logprob"] is None and len(d["tokens"]) > 5 and d["perplexity"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["score.json"]  # no temporary file left behind
    expected = lmtrace.score(tiny_lm, "Hello world, the quick brown fox")
    assert d["total_logprob"] == pytest.approx(expected.total_logprob, abs=1e-4)
    for word in ("tokens scored", "perplexity", "bits/byte", "rank", "entropy", "no context"):
        assert word in out


def test_score_prompt_and_continuation_to_stdout(capsys, tiny_dir):
    code, out, err = run(
        capsys, "score", "--prompt", "Hello", "--continuation", " world", "--model", tiny_dir, "--json", "-"
    )
    assert code == 0
    d = json.loads(out)
    assert d["prompt"] == "Hello" and d["text"] == " world" and d["tokens"][0]["logprob"] is not None
    assert "perplexity" in err  # the view goes to stderr


def test_score_file_and_sliding_window(capsys, tiny_dir, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("Once upon a time there was a little model that counted tokens. " * 3)
    code, out, _ = run(capsys, "score", "--file", f, "--window", 16, "--stride", 8, "--model", tiny_dir, "--json", "-")
    assert code == 0
    d = json.loads(out[out.index("{") :])
    assert (d["window"], d["stride"]) == (16, 8) and d["scored_tokens"] == len(d["token_ids"]) - 1


BAD = [
    (["Hello", "--window", "1"], "window must be >= 2, got 1"),
    (["Hello", "--window", "300"], "window must be in [2, 256], got 300"),
    (["Hello", "--stride", "0"], "stride must be >= 1, got 0"),
    (["Hello", "--top-logprobs", "101"], "top_logprobs must be in [0, 100], got 101"),
    (["--prompt", "Hello"], "--continuation: none given (--prompt and --continuation go together)"),
    (
        ["Hello", "--prompt", "a", "--continuation", "b"],
        "text: give TEXT (or --file), or --prompt with --continuation, not both",
    ),
    (["--file", "/nonexistent/x.txt"], "file: cannot read '/nonexistent/x.txt' (No such file or directory)"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m[:40] for _, m in BAD])
def test_score_bad_input_exits_2_with_one_line(capsys, tiny_dir, args, message):
    code, _, err = run(capsys, "score", *args, "--model", tiny_dir)
    assert code == 2 and one_error(err) == f"lmtrace: error: {message}"


def test_score_jsonl_batch(capsys, tiny_dir, tiny_lm, tmp_path):
    records = [
        {"id": "a", "text": "Hello world"},
        {"id": 7, "prompt": "Once upon a time", "continuation": " there was"},
        {"text": "很久很久以前"},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n\n")
    code, out, _ = run(capsys, "score", "--jsonl", src, dst, "--batch-size", 2, "--model", tiny_dir)
    assert code == 0
    lines = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["a", 7, 3]  # a record without an id gets its line number
    singles = [
        lmtrace.score(tiny_lm, "Hello world"),
        lmtrace.score(tiny_lm, prompt="Once upon a time", continuation=" there was"),
        lmtrace.score(tiny_lm, "很久很久以前"),
    ]
    for line, single in zip(lines, singles):
        assert line["token_ids"] == single.token_ids
        assert line["total_logprob"] == pytest.approx(single.total_logprob, abs=1e-4)
    assert "3 scores written to" in out and "perplexity" in out


def test_score_file_jsonl_is_a_list_into_one_json(capsys, tiny_dir, tiny_lm, tmp_path):
    src, dst = tmp_path / "texts.jsonl", tmp_path / "scores.json"
    src.write_text('{"text": "Hello world"}\n{"id": "b", "text": "很久很久以前"}\n')
    code, out, _ = run(capsys, "score", "--file", src, "--model", tiny_dir, "--json", dst, "--top-logprobs", 2)
    assert code == 0
    d = json.loads(dst.read_text())
    assert [x["id"] for x in d] == [1, "b"]
    for x, text in zip(d, ["Hello world", "很久很久以前"]):
        assert x["total_logprob"] == pytest.approx(lmtrace.score(tiny_lm, text).total_logprob, abs=1e-4)
        assert all(len(t["top"]) == 2 for t in x["tokens"][1:])
    assert "2 scores written to" in out
    code, _, err = run(capsys, "score", "--file", src, "--html", tmp_path / "r.html", "--model", tiny_dir)
    assert code == 2 and "file: a .jsonl list is scored into --json" in err


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"text": "a"}\nnot json\n', "jsonl: line 2 of {src} is not JSON"),
        ('{"prompt": "a"}\n', "jsonl: line 1 of {src} needs a string 'text', or strings 'prompt' and 'continuation'"),
        ("\n", "jsonl: no records in {src}"),
    ],
)
def test_score_jsonl_bad_lines(capsys, tiny_dir, tmp_path, content, message):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    code, _, err = run(capsys, "score", "--jsonl", src, tmp_path / "out.jsonl", "--model", tiny_dir)
    assert code == 2 and err.startswith(f"lmtrace: error: {message.format(src=src)}") and err.count("\n") == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_generate_echo_and_waterfall(capsys, tiny_dir, tmp_path):
    path = tmp_path / "t.json"
    args = ["generate", "Hello world", "--model", tiny_dir, "--max-new-tokens", 4, "--temperature", 0.8]
    args += ["--top-k", 20, "--top-p", 0.6, "--seed", 1, "--echo", "--waterfall", 1, "--json", path]
    code, out, _ = run(capsys, *args)
    assert code == 0
    d = json.loads(path.read_text())
    assert d["prompt_logprobs"][0]["logprob"] is None and len(d["prompt_logprobs"]) == len(d["prompt"]["token_ids"])
    assert [("waterfall" in s) for s in d["steps"]] == [False, True, False, False]
    assert [s["stage"] for s in d["steps"][1]["waterfall"]][-2:] == ["top_p", "min_p"]
    for word in ("prompt tokens", "the distribution after each stage", "top p", "removed", "raw rank"):
        assert word in out


def test_generate_bad_waterfall_step(capsys, tiny_dir):
    code, _, err = run(capsys, "generate", "Hi", "--model", tiny_dir, "--max-new-tokens", 5, "--waterfall", 9)
    assert code == 2 and err == "lmtrace: error: waterfall must be a step index in [0, 4] or 'all', got 9\n"


def test_branch(capsys, tiny_dir, tmp_path):
    path = tmp_path / "b.json"
    args = ["branch", "Once upon a time", "--at", 2, "--alternative", 2, "--alternative", 3, "--model", tiny_dir]
    code, out, _ = run(capsys, *args, "--max-new-tokens", 6, "--temperature", 0, "--json", path)
    assert code == 0
    d = json.loads(path.read_text())
    assert d["at"] == 2 and d["alternatives"] == [None, 2, 3] and len(d["branches"]) == 3
    assert [b["steps"][2]["rank"] for b in d["branches"][1:]] == [2, 3]
    assert "original" in out and "#2" in out and "#3" in out and "logprob" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--at", "9"], "at must be in [0, 5], got 9"),
        (["--at", "1", "--alternative", "2", "--fan", "2"], "alternative: give --alternative or --fan, not both"),
        (["--at", "1", "--fan", "0"], "fan must be in [1, 300], got 0"),
    ],
)
def test_branch_bad_input(capsys, tiny_dir, args, message):
    code, _, err = run(capsys, "branch", "Hi", "--model", tiny_dir, "--max-new-tokens", 6, *args)
    assert code == 2 and one_error(err) == f"lmtrace: error: {message}"


def test_help_lists_the_new_commands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "score" in out and "branch" in out
    _, out, _ = run(capsys, "score", "--help")
    for opt in ("--prompt", "--continuation", "--file", "--jsonl", "--window", "--stride", "--batch-size", "--json"):
        assert opt in out
    _, out, _ = run(capsys, "generate", "--help")
    assert "--echo" in out and "--waterfall" in out
