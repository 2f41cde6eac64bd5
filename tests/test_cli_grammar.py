"""Constraints on the command line and in batch jobs: `generate --json-schema/--regex/--choice/
--grammar` write `fields` / `choices` / step `grammar` and show them; bad input is one line and
exit 2 with nothing written; batch lines carry the same keys, rows of any constraint (and none)
decode together and each equals itself alone."""

from __future__ import annotations

import json

import pytest

from lmtrace import SamplingParams
from lmtrace.cli import main
from lmtrace.decode import tracing
from tests.cli_errors import one_error
from tests.same_record import assert_same, by_id, read_records
from tests.tiny import plain_tokenizer, tiny_model

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}, "w": {"type": "string",
          "maxLength": 3}}, "required": ["n", "w"]}  # fmt: skip


def run(tiny_dir, *args) -> int:
    return main(["generate", "Hello", "--model", str(tiny_dir), "--temperature", "0", "--no-color", *args])


def test_json_schema_writes_fields_and_shows_them(capsys, tiny_dir, tmp_path):
    schema, out, html = tmp_path / "s.json", tmp_path / "t.json", tmp_path / "r.html"
    schema.write_text(json.dumps(SCHEMA))
    assert run(tiny_dir, "--json-schema", str(schema), "--max-new-tokens", "30", "--json", str(out),
               "--html", str(html)) == 0  # fmt: skip
    trace = json.loads(out.read_text())
    assert trace["params"]["json_schema"] == SCHEMA and trace["params"]["json_whitespace"] == "compact"
    assert {f["path"] for f in trace["fields"]} == {"$.n", "$.w"}
    assert all("grammar" in s for s in trace["steps"])
    shown = capsys.readouterr().out
    assert "fields, least sure first" in shown and "$.n" in shown and "grammar removed" in shown
    page = html.read_text()
    assert 'id="fields"' in page and 'class="field"' in page and 'id="grammar"' in page


def test_choice_shows_each_option(capsys, tiny_dir, tmp_path):
    out = tmp_path / "t.json"
    assert run(tiny_dir, "--choice", "yes", "--choice", "no", "--choice", "maybe", "--json", str(out)) == 0
    trace = json.loads(out.read_text())
    assert [c["text"] for c in trace["choices"]] == ["yes", "no", "maybe"] and trace["text"] in ("yes", "no", "maybe")
    shown = capsys.readouterr().out
    assert "choices" in shown and "tokenizations" in shown and "maybe" in shown


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A model whose vocabulary has no "Q" (no byte fallback)."""
    path = tmp_path_factory.mktemp("plain-model")
    tok = plain_tokenizer()
    tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def bad_cases(tmp_path):
    (tmp_path / "notjson.json").write_text("{nope")
    (tmp_path / "foo.json").write_text('{"type": "foo"}')
    (tmp_path / "unique.json").write_text('{"type": "array", "uniqueItems": true}')
    (tmp_path / "g.ebnf").write_text("root ::= item")
    d = str(tmp_path)
    return [
        (["--json-schema", f"{d}/notjson.json"], "json-schema: '" + d + "/notjson.json' is not JSON"),
        (["--json-schema", f"{d}/foo.json"], 'json_schema does not compile (Unsupported type "foo")'),
        (["--json-schema", f"{d}/unique.json"], "json_schema: uniqueItems at # is not supported"),
        (["--json-schema", f"{d}/none.json"], "json-schema: cannot read"),
        (["--regex", "(ab"], "regex does not compile (Regex parsing error"),
        (["--grammar", f"{d}/g.ebnf"], "grammar does not compile (EBNF parser error"),
        (["--regex", "a+", "--choice", "x", "--choice", "y"], "choice: one constraint at a time, got regex and choice"),
        (["--choice", "only"], "choice needs two options or more (one is no choice), got only 'only'"),
        (["--choice", "x", "--choice", "x"], "choice must list each option once, got 'x' twice"),
    ]


def test_bad_input_is_one_line_exit_2_and_nothing_written(capsys, tiny_dir, plain_dir, tmp_path):
    out = tmp_path / "never.json"
    cases = bad_cases(tmp_path) + [(["--regex", "Q+"], "regex: the grammar allows no token at step 0")]
    for args, message in cases:
        model = plain_dir if args == ["--regex", "Q+"] else tiny_dir
        code = main(["generate", "the", "--model", str(model), "--json", str(out), "--html", str(out) + ".html",
                     "--max-new-tokens", "4", *args])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and one_error(err).startswith(f"lmtrace: error: {message}"), (args, err)
        assert not out.exists() and not (tmp_path / "never.json.html").exists()


def test_batch_lines_with_constraints_and_without_decode_together(tmp_path, tiny_dir, tiny_lm):
    lines = [
        {"id": 1, "prompt": "Hello world", "json_schema": SCHEMA},
        {"id": 2, "prompt": "Once upon a time", "regex": "[a-c]{3}[0-9]", "temperature": 0.8, "seed": 4},
        {"id": 3, "prompt": "The cat", "choice": ["the quick", "world"]},
        {"id": 4, "prompt": "很久很久以前，"},
        {"id": 5, "prompt": "A", "grammar": 'root ::= "(" [a-z]+ ")"'},
        {"id": 6, "prompt": "B", "regex": "(ab"},
        {"id": 7, "prompt": "C", "choice": ["only"]},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--model", str(tiny_dir), "--temperature", "0", "--max-new-tokens", "12", "--batch-size", "8"]
    assert main(["batch", str(src), str(out), *args]) == 0
    records = by_id(read_records(out))
    assert records[6]["error"].startswith("regex does not compile") and records[7]["error"].startswith("choice needs")
    for line in lines[:5]:
        keys = {k: v for k, v in line.items() if k not in ("id", "prompt")}
        alone = tracing.generate(tiny_lm, line["prompt"], SamplingParams(**{"temperature": 0, "max_new_tokens": 12,
                                                                          **keys}))  # fmt: skip
        got = records[line["id"]]["trace"]
        assert got["token_ids"] == alone.token_ids, line
        assert_same(got, json.loads(alone.to_json()) | {"model": got["model"]}, tol=5e-5)
