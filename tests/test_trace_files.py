"""A trace's files: compact JSON by default (indented when asked), JSON Lines written step by step
(header, a line per step, closing line), the lens and attention in columns (per-layer arrays, token
texts once, float32 digits) and read back equal to the trace; sizes per step on a long trace of
the bundled model's shape."""

from __future__ import annotations

import io
import json

import pytest

import lmtrace
from lmtrace import trace_file
from lmtrace.cli import main
from lmtrace.columnar import Tokens, float32, from_columns, short, to_columns
from lmtrace.records import Trace
from tests.long_trace import long_trace


@pytest.fixture(scope="module")
def inside(tiny_lm):
    return lmtrace.generate(tiny_lm, "Hello world, the quick brown fox", max_new_tokens=12, temperature=0,
                            top_logprobs=3, lens=True, attention="heads", stop_on_eos=False)  # fmt: skip


def _json(trace: Trace, indent: int | None = None, columnar: bool = True) -> str:
    out = io.StringIO()
    trace_file.write_json(out, trace, indent, columnar)
    return out.getvalue()


def _lines(trace: Trace) -> str:
    out = io.StringIO()
    trace_file.write_lines(out, trace)
    return out.getvalue()


def test_both_forms_read_back_equal_and_pack_every_step(inside):
    full = inside.to_dict()
    for text in (_json(inside), _json(inside, 2), _lines(inside)):
        assert Trace.from_json(text).to_dict() == full
    d = json.loads(_json(inside))
    assert d["columnar"] == 1 and all(isinstance(s["lens"]["layers"], dict) for s in d["steps"])
    assert all(isinstance(s["attention"]["layers"], dict) for s in d["steps"])
    shown = [int(k) for s in d["steps"] for k in s.get("token_texts", {})]
    assert len(shown) == len(set(shown))  # each token's text once per trace
    assert "\n" not in _json(inside).rstrip("\n")  # compact: one line
    assert json.loads(_json(inside, 2)) == d  # indented: the same document
    plain = json.loads(_json(inside, columnar=False))  # --json: the documented shape, compact
    assert "columnar" not in plain and plain["steps"][0]["lens"] == full["steps"][0]["lens"]
    assert plain["steps"][-1]["attention"] == full["steps"][-1]["attention"]


def test_json_lines_layout(inside):
    lines = _lines(inside).splitlines()
    head, steps, end = json.loads(lines[0]), lines[1:-1], json.loads(lines[-1])
    assert head["lmtrace"] == "header" and "steps" not in head and head["prompt"] == inside.prompt
    assert len(steps) == len(inside.steps) and [json.loads(s)["index"] for s in steps] == list(range(12))
    assert end["lmtrace"] == "end" and end["text"] == inside.text and end["finish_reason"] == "length"
    assert "timing" in end and "token_ids" not in end  # the steps hold them
    with pytest.raises(ValueError, match="closing line"):
        Trace.from_json("\n".join(lines[:-1]))


def test_an_entry_that_would_not_read_back_equal_stays_as_it_is(inside):
    step = inside.to_dict()["steps"][3]
    step["lens"]["layers"][1]["entropy"] = 0.1  # a float64 number: float32 digits would change it
    step["attention"]["layers"][0]["top"][0]["token_id"] += 1  # not the token at its position
    tokens = Tokens(inside.prompt["token_ids"] + inside.token_ids[:3])
    columns = to_columns(step, tokens)
    assert columns["lens"] == step["lens"] and columns["attention"] == step["attention"]
    assert from_columns(columns, Tokens(inside.prompt["token_ids"] + inside.token_ids[:3])) == step


def test_float32_digits_are_the_shortest_that_read_back():
    for x in (float32(0.1), float32(-27.259899139404297), float32(1e-30), 0.5, float32(3.4e38)):
        s = repr(short(x))
        assert float32(float(s)) == x and len(s.lstrip("-").replace(".", "").split("e")[0]) <= 9
    assert repr(short(float32(0.1))) == "0.1"


def test_sizes_per_step_on_a_long_trace_of_the_bundled_shape():
    n = 96
    for with_inside, limit in ((False, 7 * 1024), (True, 40 * 1024)):
        trace = long_trace(n, with_inside)
        text = _json(trace)
        assert len(text.encode()) / n <= limit
        assert len(text.encode()) < 0.75 * len(trace.to_json(indent=2).encode())
    assert Trace.from_json(text).to_dict() == trace.to_dict()
    assert Trace.from_json(_lines(trace)).to_dict() == trace.to_dict()


def test_lines_are_spooled_as_steps_come_and_a_failure_leaves_no_file(inside, tmp_path):
    path = tmp_path / "t.jsonl"
    with trace_file.TraceLines(path, inside.prompt["token_ids"]) as lines:
        for step in inside.steps:
            before = lines.spool.tell()
            lines.step(step)
            assert lines.spool.tell() > before  # written at once, not kept
        lines.close(inside)
    assert Trace.from_json(path.read_text(encoding="utf-8")).to_dict() == inside.to_dict()
    broken = tmp_path / "broken.jsonl"
    with pytest.raises(RuntimeError), trace_file.TraceLines(broken, inside.prompt["token_ids"]) as lines:
        lines.step(inside.steps[0])
        raise RuntimeError("the generation failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # no file, no spool left


def test_generate_jsonl_json_indent_and_ignore_eos(tiny_dir, tmp_path, capsys):
    out, lines = tmp_path / "t.json", tmp_path / "t.jsonl"
    args = ["generate", "Hello world", "--model", str(tiny_dir), "--max-new-tokens", "24", "--temperature", "0",
            "--lens", "--attention", "--ignore-eos", "--no-color"]  # fmt: skip
    assert main([*args, "--json", str(out), "--jsonl", str(lines)]) == 0
    saved = Trace.from_json(out.read_text(encoding="utf-8"))
    assert len(saved.steps) == 24 and saved.params["stop_on_eos"] is False
    assert Trace.from_json(lines.read_text(encoding="utf-8")).to_dict() == saved.to_dict()
    assert main(["render", str(lines), "--html", str(tmp_path / "r.html")]) == 0
    assert main([*args, "--json", str(out), "--json-indent", "2"]) == 0
    assert out.read_text(encoding="utf-8").startswith('{\n  "model": {\n    "source"')
    capsys.readouterr()
    for bad, said in ((["--json-indent", "2"], "json-indent: indents the --json output"),
                      (["--jsonl", str(tmp_path / "no" / "t.jsonl")], "jsonl: no such folder"),
                      (["--jsonl", "-"], "jsonl: a file of its own")):  # fmt: skip
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0]


def test_other_commands_write_compact_json(tiny_dir, tmp_path):
    out = tmp_path / "s.json"
    assert main(["score", "Hello world", "--model", str(tiny_dir), "--json", str(out)]) == 0
    assert out.read_text(encoding="utf-8").count("\n") == 1
    assert main(["score", "Hello world", "--model", str(tiny_dir), "--json", str(out), "--json-indent", "1"]) == 0
    assert out.read_text(encoding="utf-8").startswith("{\n ")


def test_progress_shows_tokens_per_second():
    from rich.console import Console
    from rich.progress import Progress

    from lmtrace.cli.generate import RateColumn

    with Progress(RateColumn(), console=Console(file=io.StringIO()), disable=True) as progress:
        task = progress.add_task("generate", total=10)
        assert RateColumn().render(progress.tasks[task]).plain == ""  # no estimate yet
        progress.advance(task)
        progress.advance(task)
        assert RateColumn().render(progress.tasks[task]).plain.endswith(" tok/s")


def test_a_file_written_before_the_columnar_name_still_reads(inside):
    """Files written before the form was named `columnar` said `"packed": 1`: they read back equal."""
    old = json.loads(_json(inside))
    old["packed"] = old.pop("columnar")
    assert Trace.from_json(json.dumps(old)).to_dict() == inside.to_dict()
    lines = _lines(inside).splitlines()
    head = json.loads(lines[0])
    head["packed"] = head.pop("columnar")
    assert Trace.from_json("\n".join([json.dumps(head), *lines[1:]])).to_dict() == inside.to_dict()
