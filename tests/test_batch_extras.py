"""A batch line's echo, waterfall, attribution and processors: the processors the command
registered by name (--logits-processor NAME=module:function, as vLLM v1's --logits-processors),
each line's error its own."""

from __future__ import annotations

import json

import pytest

import lmtrace
from lmtrace.batch.job import run_job
from lmtrace.batch.local import local_engine
from lmtrace.logits import named
from tests.composability import BATCHED_TOL, comparable, differences, no_top_token
from tests.same_record import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
SPEC = "no_top=tests.composability:no_top_token"


def run_lines(tmp_path, lm, lines: list[dict], defaults: dict) -> dict:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    run_job(src, out, local_engine(lambda: lm, defaults, 4))
    return {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}


def test_lines_name_the_commands_processors_and_record_as_generate(tmp_path, tiny_lm):
    base = {"max_new_tokens": 4, "temperature": 0, "top_logprobs": 2}
    lines = [
        {"id": "p", "prompt": "Hello world", "logits_processors": ["no_top_token"], "waterfall": "all", **base},
        {"id": "e", "prompt": "Once upon a time", "echo": True, "attribution": True, **base},
        {"id": "plain", "prompt": "The quick brown fox", **base},
    ]
    # registered under the function's own name: the name generate records it under
    got = run_lines(tmp_path, tiny_lm, lines, {"logits_processors": ["no_top_token=" + SPEC.split("=")[1]]})
    alone = {
        "p": lmtrace.generate(tiny_lm, "Hello world", logits_processors=[no_top_token], waterfall="all", **base),
        "e": lmtrace.generate(tiny_lm, "Once upon a time", echo=True, attribution=True, **base),
        "plain": lmtrace.generate(tiny_lm, "The quick brown fox", **base),
    }
    for key, trace in alone.items():
        record = got[key]["trace"]
        assert record["token_ids"] == trace.token_ids
        found = differences(comparable(record), comparable(trace.to_dict()), BATCHED_TOL)
        assert not found, (key, found[:4])


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ({"logits_processors": ["missing"]}, ("logits_processors", "'missing'", "no_top")),
        ({"logits_processors": "no_top"}, ("logits_processors", "list")),
        ({"waterfall": 9}, ("waterfall", "9")),
        ({"against": "rank:3"}, ("against", "attribution")),
        ({"echo": "yes"}, ("echo", "'yes'")),
        ({"compile": "yes"}, ("compile", "'yes'")),
        ({"compile": True, "lens": True}, ("compile", "lens")),
    ],
)
def test_a_line_that_asks_wrongly_gets_its_own_one_line_error(tmp_path, tiny_lm, line, words):
    lines = [{"id": "bad", "prompt": "Hello", "max_new_tokens": 3, **line}, {"id": "ok", "prompt": "Hi"}]
    got = run_lines(tmp_path, tiny_lm, lines, {"logits_processors": [SPEC], "max_new_tokens": 3})
    error = got["bad"]["error"]
    assert "\n" not in error and all(w in error for w in words), error
    assert "trace" in got["ok"]


@pytest.mark.parametrize(
    ("specs", "words"),
    [
        (["no_top"], ("NAME=module:function", "'no_top'")),
        (["a=tests.composability"], ("NAME=module:function",)),
        (["a=tests.nowhere:f"], ("cannot import", "tests.nowhere")),
        (["a=tests.composability:PROMPT"], ("not callable",)),
        ([SPEC, SPEC], ("once", "no_top")),
    ],
)
def test_a_registration_the_command_cannot_make_is_refused(specs, words):
    with pytest.raises(lmtrace.InvalidParameter) as e:
        named.registry(specs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_registry_is_names_to_functions():
    known = named.registry([SPEC, "same=tests.composability:no_top_token"])
    assert known == {"no_top": no_top_token, "same": no_top_token}
    assert [u.name for u in named.resolve(["same", "no_top"], known)] == ["same", "no_top"]
    assert named.registry({"f": no_top_token}) == {"f": no_top_token}


def test_the_command_registers_processors_and_echoes_every_line(tmp_path, tiny_dir):
    from lmtrace.cli import main

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": 1, "prompt": "Hello", "logits_processors": ["no_top"]}\n{"id": 2, "prompt": "Hi"}\n')
    args = ["--max-new-tokens", "3", "--temperature", "0", "--echo", "--logits-processor", SPEC, "--no-color"]
    assert main(["batch", str(src), str(out), "--model", str(tiny_dir), *args]) == 0
    got = {r["id"]: r["trace"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert got[1]["params"]["logits_processors"] == ["no_top"] and "logits_processors" not in got[2]["params"]
    assert all(t["prompt_logprobs"] for t in got.values())
