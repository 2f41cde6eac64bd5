"""`lmtrace rollouts` in-process on the tiny model: JSON in the contract's shape, the terminal
view, the HTML report (model text escaped, no script); bad input is one line naming the line
and the field, exit 2, and nothing is written."""

from __future__ import annotations

import json

import pytest

from lmtrace.cli import main
from tests import rollout_world as world
from tests.cli_errors import one_error


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def rollout_file(tiny_lm, tmp_path_factory):
    records = world.clean(tiny_lm, seed=1, temperature=0.7) + world.temperature_raw(tiny_lm)
    records = [{**r, "id": f"<b>{i}</b>"} for i, r in enumerate(records)]
    path = tmp_path_factory.mktemp("rollouts") / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_rollouts_writes_json_html_and_the_terminal_view(capsys, tiny_dir, rollout_file, tmp_path):
    js, html = tmp_path / "r.json", tmp_path / "r.html"
    code, out, err = run(capsys, "rollouts", rollout_file, "--model", tiny_dir, "--cap", 2, "--cap", 3,
                         "--json", js, "--html", html, "--no-color")  # fmt: skip
    assert code == 0, err
    d = json.loads(js.read_text())
    s = d["summary"]
    assert {"sequences", "tokens", "mean_abs_delta", "k1", "k2", "k3", "ppl_ratio", "outside_0_9_1_1", "caps",
            "causes"} <= set(s)  # fmt: skip
    assert [c["cap"] for c in s["caps"]] == [2.0, 3.0]
    assert set(s["caps"][0]) == {"cap", "tokens_clipped", "tokens_masked", "sequences_masked"}
    assert s["causes"] == [{"cause": "processing_mismatch", "sequences": 3}]
    r = d["rollouts"][0]
    assert set(r) >= {"id", "causes", "tokens"} and r["causes"] == []
    assert set(r["tokens"][0]) >= {"index", "token_id", "engine_logprob", "raw_logprob", "processed_logprob",
                                   "trainer_logprob", "processing", "residual", "ratio", "flagged"}  # fmt: skip
    assert {"cause", "detail", "evidence"} == set(d["rollouts"][3]["causes"][0])
    assert "processing_mismatch: 3 rollouts" in out and "TIS / MIS caps" in out
    page = html.read_text()
    assert "<b>0</b>" not in page and "&lt;b&gt;0&lt;/b&gt;" in page and "<script" not in page
    assert "processing_mismatch" in page and "<svg" in page


def test_locate_in_the_report(capsys, tiny_dir, rollout_file, tmp_path):
    js = tmp_path / "l.json"
    code, _, err = run(capsys, "rollouts", rollout_file, "--model", tiny_dir, "--locate", "dtype:bfloat16",
                       "--locate-threshold", 1e-3, "--json", js)  # fmt: skip
    assert code == 0, err
    loc = json.loads(js.read_text())["locate"]
    assert [x["layer"] for x in loc["layers"]] == ["embed", "L0", "L1", "norm", "lm_head"]
    assert loc["first_over"] in {x["layer"] for x in loc["layers"]} and loc["flagged"] is True


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "sglang"], "format: unknown format 'sglang'"),
        (["--cap", "0.5"], "cap must be a number > 1"),
        (["--trainer", "fp8"], "variant: unknown kind 'fp8'"),
        (["--locate", "batch:4"], "locate: 'batch:4' has no model of its own"),
    ],
)
def test_bad_options_exit_2_before_the_model_loads(capsys, rollout_file, tmp_path, args, message):
    js = tmp_path / "out.json"
    code, _, err = run(capsys, "rollouts", rollout_file, "--model", tmp_path / "missing", "--json", js, *args)
    assert code == 2 and message in one_error(err) and not js.exists()


def test_a_line_that_is_not_json(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1]}\n{not json\n')
    code, _, err = run(capsys, "rollouts", path, "--format", "lmtrace")
    assert code == 2 and "rollouts: line 2: line is not JSON" in one_error(err)


GOOD = {"prompt_ids": [1, 2], "completion_ids": [3, 4], "logprobs": [-1.0, -1.5]}


def in_format(fmt: str, record: dict, k: int = 0) -> dict:
    """One line of `fmt` holding `record` (tests/test_rollouts_formats.py writes each as its framework does)."""
    from tests import test_rollouts_formats as formats

    if fmt == "lmtrace":
        return dict(record)
    if fmt == "trl":
        return formats.trl_batch([record])
    if fmt == "verl":
        return {**formats.verl_batch([record]), "uid": [f"q{k}"]}
    return formats.vllm_output(record, k) if fmt == "vllm" else formats.openai_response(record, k, False)


def broken(fmt: str, case: str) -> dict:
    """A line of `fmt` with one fault: no completion ids, one logprob too few, an id outside the vocabulary."""
    if case == "vocabulary":
        line = in_format(fmt, {**GOOD, "completion_ids": [3, 99999]})
        if fmt == "openai":  # the ids given as token_ids (vLLM's return_token_ids)
            line["choices"][0]["token_ids"] = [3, 99999]
        return line
    if case == "length":
        if fmt in ("trl", "verl"):  # a padded batch: the logprobs row a column short of the completion row
            line = in_format(fmt, GOOD)
            key = "sampling_per_token_logps" if fmt == "trl" else "rollout_log_probs"
            line[key][0] = line[key][0][:-1]
            return line
        line = in_format(fmt, {**GOOD, "logprobs": [-1.0]})
        if fmt == "openai":
            line["choices"][0]["token_ids"] = [3, 4]
        return line
    line = in_format(fmt, GOOD)
    if fmt == "vllm":
        del line["outputs"][0]["token_ids"]
    elif fmt == "openai":
        for entry in line["choices"][0]["logprobs"]["content"]:
            del entry["token_id"]
    else:
        del line[{"lmtrace": "completion_ids", "trl": "completion_ids", "verl": "responses"}[fmt]]
    return line


FIELDS = {  # (format, fault) -> the error's words: the line and the field
    ("lmtrace", "missing"): "line 2: completion_ids is missing",
    ("lmtrace", "length"): "line 2: logprobs has 1 values for 2 completion ids",
    ("lmtrace", "vocabulary"): "line 2: completion_ids[1] = 99999 is outside the model's vocabulary",
    ("trl", "missing"): "line 2: completion_ids is missing",
    ("trl", "length"): "line 2: sampling_per_token_logps[0] has 3 values for the 4 columns of completion_ids[0]",
    ("trl", "vocabulary"): "line 2: completion_ids[0][1] = 99999 is outside the model's vocabulary",
    ("verl", "missing"): "line 2: responses is missing",
    ("verl", "length"): "line 2: rollout_log_probs[0] has 3 values for the 4 columns of responses[0]",
    ("verl", "vocabulary"): "line 2: responses[0][1] = 99999 is outside the model's vocabulary",
    ("vllm", "missing"): "line 2: outputs[0].token_ids is missing",
    ("vllm", "length"): "line 2: outputs[0].logprobs has 1 values for 2 completion ids",
    ("vllm", "vocabulary"): "line 2: outputs[0].token_ids[1] = 99999 is outside the model's vocabulary",
    ("openai", "missing"): "line 2: choices[0].logprobs.content[0].token carries no token id",
    ("openai", "length"): "line 2: choices[0].logprobs.content has 1 values for 2 completion ids",
    ("openai", "vocabulary"): "line 2: choices[0].token_ids[1] = 99999 is outside the model's vocabulary",
}


@pytest.mark.parametrize("fmt, case", list(FIELDS))
def test_bad_lines_exit_2_name_the_line_and_the_field_and_write_nothing(capsys, tiny_dir, tmp_path, fmt, case):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(in_format(fmt, {**GOOD, "id": "a"}, k=1)) + "\n" + json.dumps(broken(fmt, case)) + "\n")
    js, html = tmp_path / "out.json", tmp_path / "out.html"
    code, _, err = run(capsys, "rollouts", path, "--format", fmt, "--model", tiny_dir, "--json", js, "--html", html)
    assert code == 2 and "rollouts: " + FIELDS[fmt, case] in one_error(err)
    assert not js.exists() and not html.exists()
