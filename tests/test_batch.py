"""`lmtrace batch` in-process on the tiny model: one line per id, equal to `lmtrace generate`
on the same prompt and settings, whatever the batch size; errors per line; resume."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from lmtrace.batch import InputLine, defaults_of
from lmtrace.batch.output import OutputFile
from lmtrace.batch.prepare import prepare
from lmtrace.cli import main
from lmtrace.errors import InvalidParameter
from lmtrace.params import SamplingParams
from tests.same_record import assert_same, by_id, one_thread, read_records  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
DEFAULTS = ["--temperature", "0", "--max-new-tokens", "8", "--top-logprobs", "3"]
LINES = [
    {"id": "hello", "prompt": "Hello world"},
    {"id": "zh", "prompt": "很久很久以前，", "max_new_tokens": 5},
    {"id": 7, "prompt": "Once upon a time", "temperature": 0.8, "top_k": 20, "seed": 4},
    {"id": "s1", "prompt": "the quick brown fox", "temperature": 0.9, "seed": 1},
    {"id": "s2", "prompt": "Hello", "temperature": 0.9, "seed": 2},
    {"id": "bad", "prompt": "Hi", "top_p": 2},
    "not json",
    {"id": "hello", "prompt": "the same id again"},
    {"id": "long", "prompt": "Hello world", "max_new_tokens": 400},
    {"id": "emoji", "prompt": "🙂 wörld, naïve", "stop": ["o"]},
    {"id": "fox", "prompt": "the lazy dog", "top_logprobs": 1},
]
ERRORS = {"bad": "top_p must be in (0, 1], got 2.0", "long": "max_new_tokens must fit the context"}


def write_input(path, lines=LINES):
    text = "\n".join(line if isinstance(line, str) else json.dumps(line, ensure_ascii=False) for line in lines)
    path.write_text(text + "\n\n", encoding="utf-8")  # a blank line at the end is allowed
    return path


def run_batch(tiny_dir, src, out, *extra):
    return main(["batch", str(src), str(out), "--model", str(tiny_dir), *DEFAULTS, *extra])


def generate_alone(tiny_dir, tmp_path, line):
    """`lmtrace generate` with the line's own fields over DEFAULTS."""
    args = list(DEFAULTS)
    for key in ("temperature", "top_k", "seed", "max_new_tokens", "top_logprobs"):
        if key in line:
            args += [f"--{key.replace('_', '-')}", str(line[key])]
    for stop in line.get("stop", []):
        args += ["--stop", stop]
    out = tmp_path / f"alone-{line['id']}.json"
    assert main(["generate", line["prompt"], "--model", str(tiny_dir), *args, "--json", str(out), "--no-color"]) == 0
    return json.loads(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_dir):
    """The mixed file run with batch size 4 (rows of different settings share batches)."""
    tmp = tmp_path_factory.mktemp("mixed")
    out = tmp / "out.jsonl"
    assert run_batch(tiny_dir, write_input(tmp / "in.jsonl"), out, "--batch-size", "4") == 0
    return by_id(read_records(out))


def test_one_line_per_id_and_errors_per_line(mixed):
    assert set(mixed) == {"hello", "zh", 7, "s1", "s2", "bad", "long", "emoji", "fox"}
    for id_, message in ERRORS.items():
        assert set(mixed[id_]) == {"id", "error"} and message in mixed[id_]["error"]
    assert mixed["hello"]["trace"]["prompt"]["text"] == "Hello world"  # the first line with the id


def test_each_trace_equals_lmtrace_generate_alone(mixed, tiny_dir, tmp_path):
    for line in LINES:
        if isinstance(line, dict) and line["id"] not in ERRORS and line["prompt"] != "the same id again":
            assert_same(mixed[line["id"]]["trace"], generate_alone(tiny_dir, tmp_path, line))


def test_output_does_not_depend_on_the_batch_size(mixed, tiny_dir, tmp_path):
    out = tmp_path / "one.jsonl"
    assert run_batch(tiny_dir, write_input(tmp_path / "in.jsonl"), out, "--batch-size", "1") == 0
    assert_same(by_id(read_records(out)), mixed)


def test_bad_lines_are_named_on_stderr(capsys, tiny_dir, tmp_path):
    assert run_batch(tiny_dir, write_input(tmp_path / "in.jsonl", LINES[5:8]), tmp_path / "out.jsonl") == 0
    err = capsys.readouterr().err
    # in this file the line with id "hello" is the first with it
    assert "in.jsonl:2: not a JSON object" in err and "repeats" not in err
    assert "2 lines written" in err and "(1 errors)" in err


def test_resume_redoes_a_half_written_last_line_and_skips_complete_ids(mixed, tiny_dir, tmp_path, capsys):
    src, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    complete = [json.dumps(mixed[i], ensure_ascii=False) for i in ("hello", "bad", 7)]
    half = json.dumps(mixed["zh"], ensure_ascii=False)[:100]  # a job killed while writing "zh"
    out.write_text("\n".join(complete) + "\n" + half, encoding="utf-8")
    assert run_batch(tiny_dir, src, out, "--batch-size", "4") == 0
    records = by_id(read_records(out))
    assert_same(records, mixed)
    assert "cut off the half-written last line" in capsys.readouterr().err
    assert run_batch(tiny_dir, src, out) == 0  # all done: nothing written
    assert "nothing to do" in capsys.readouterr().err and len(read_records(out)) == len(mixed)


def test_an_output_with_a_broken_middle_line_is_refused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "error": "x"}\nrubbish\n{"id": "b", "error": "y"}\n')
    assert run_batch(tiny_dir, write_input(tmp_path / "in.jsonl"), out) == 2
    assert "out.jsonl:2 is not a record of lmtrace batch" in capsys.readouterr().err
    assert out.read_text().count("\n") == 3  # left as it was


def test_two_jobs_cannot_write_one_output(tmp_path):
    with OutputFile(tmp_path / "out.jsonl"):
        with pytest.raises(InvalidParameter, match="being written by another lmtrace batch job"):
            OutputFile(tmp_path / "out.jsonl").__enter__()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch-size", "0"], "batch_size must be >= 1, got 0"),
        (["--num-workers", "2"], "num_workers: only with --engine ray, got 2"),
        (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["-"], "output: must be a file (a rerun reads it to resume), got '-'"),
        (["--engine", "vllm", "--lens"], "lens: --lens runs in lmtrace's own engine; not with --engine vllm"),
        (["--engine", "vllm", "--attention"],
         "attention: --attention runs in lmtrace's own engine; not with --engine vllm"),
        (["--engine", "vllm", "--matmul", "onednn"],
         "matmul: --matmul onednn is lmtrace's own engine's; vLLM chooses its kernels"),
    ],
)
def test_bad_options_exit_2(capsys, tiny_dir, tmp_path, args, message):
    out = [] if args == ["-"] else [str(tmp_path / "o.jsonl")]
    code = main(["batch", str(write_input(tmp_path / "in.jsonl")), *out, *args])
    assert code == 2 and capsys.readouterr().err == f"lmtrace: error: {message}\n"


def test_a_missing_input_exits_2(capsys, tmp_path):
    assert main(["batch", str(tmp_path / "none.jsonl"), str(tmp_path / "o.jsonl")]) == 2
    assert "input: cannot read" in capsys.readouterr().err


def test_engine_ray_without_ray_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    code = main(["batch", str(write_input(tmp_path / "in.jsonl")), str(tmp_path / "o.jsonl"), "--engine", "ray"])
    assert code == 2 and "pip install 'lmtrace[ray]'" in capsys.readouterr().err


def test_messages_go_through_the_chat_template_like_a_chat_prompt(tiny_lm):
    tok = tiny_lm.tokenizer.__class__(tokenizer_object=tiny_lm.tokenizer.backend_tokenizer, eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    lm = replace(tiny_lm, tokenizer=tok)
    defaults = defaults_of(SamplingParams(temperature=0))
    messages = [{"role": "user", "content": "Hello world"}]
    job = prepare(lm, InputLine(1, "m", {"id": "m", "messages": messages}), defaults)
    chat = prepare(lm, InputLine(2, "c", {"id": "c", "prompt": "Hello world", "chat": True}), defaults)
    assert job.text == "user: Hello world\nassistant:" and job.chat and job.messages == messages
    assert job.ids == chat.ids and job.group == chat.group  # they may share a batch
    both = {"id": "b", "prompt": "x", "messages": messages}
    assert prepare(lm, InputLine(3, "b", both), defaults) == "prompt: give prompt or messages, not both"
    odd = {"id": "o", "messages": [{"role": "user"}]}
    assert "messages must be a non-empty list" in prepare(lm, InputLine(4, "o", odd), defaults)


def test_a_line_that_fails_while_decoding_fails_alone(tiny_lm, monkeypatch):
    from lmtrace.batch import local

    real = local.generate_rows

    def flaky(lm, specs, *args, **kwargs):
        if "boom" in [s.text for s in specs]:
            raise RuntimeError("out of memory")
        return real(lm, specs, *args, **kwargs)

    monkeypatch.setattr(local, "generate_rows", flaky)
    lines = [InputLine(i, p, {"id": p, "prompt": p}) for i, p in enumerate(["Hello", "boom", "world"], start=1)]
    outcomes = list(local.trace_lines(tiny_lm, lines, defaults_of(SamplingParams(temperature=0, max_new_tokens=2)), 3))
    records = {json.loads(o.line)["id"]: json.loads(o.line) for o in outcomes}
    assert records["boom"] == {"id": "boom", "error": "RuntimeError: out of memory"}
    assert len(records["Hello"]["trace"]["steps"]) == 2 and "trace" in records["world"]


def test_matmul_onednn_batch_equals_the_default_kernel(mixed, tiny_dir, tmp_path):
    """--matmul onednn: the same greedy tokens as the default kernel's lines, logprobs within the
    batched-versus-alone bound, and each trace says which kernel ran."""
    out = tmp_path / "onednn.jsonl"
    assert run_batch(tiny_dir, write_input(tmp_path / "in.jsonl"), out, "--batch-size", "4", "--matmul", "onednn") == 0
    fast = by_id(read_records(out))
    for key in ("hello", "zh", "emoji", "fox"):
        got, want = fast[key]["trace"], mixed[key]["trace"]
        assert got["token_ids"] == want["token_ids"]
        assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(got["steps"], want["steps"])) < 5e-5
        assert got["model"]["config"]["matmul"].startswith("onednn (")
        assert "matmul" not in want["model"]["config"]
