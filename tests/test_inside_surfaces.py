"""--lens / --attention on generate, branch and batch, the /v1/traces fields, and branches
whose steps carry the records of their own forwards."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

import lmtrace
from lmtrace.cli import main
from lmtrace.decode.branch import branch
from lmtrace.server import create_app

TINY = ["--max-new-tokens", "4", "--temperature", "0", "--top-logprobs", "3", "--no-color"]


def _has_both(step: dict) -> None:
    assert {"settled_at", "layers"} <= set(step["lens"])
    assert step["attention"]["layers"][0]["layer"] == 0


def test_generate_cli_records_and_shows_both(capsys, tiny_dir, tmp_path):
    out = tmp_path / "t.json"
    html = tmp_path / "r.html"
    args = ["generate", "Hello world", "--model", str(tiny_dir), *TINY, "--lens", "--attention"]
    assert main([*args, "--json", str(out), "--html", str(html)]) == 0
    d = lmtrace.Trace.from_json(out.read_text()).to_dict()  # the file's packed lens and attention expanded
    for step in d["steps"]:
        _has_both(step)
        assert len(step["lens"]["layers"]) == 3  # embeddings + 2 decoder layers
    assert d["params"]["lens"]["unembedding"] == "lm_head"
    assert "lens-heatmap" in html.read_text()


def test_generate_cli_attention_heads(tiny_dir, tmp_path):
    out = tmp_path / "t.json"
    args = ["generate", "Hello world", "--model", str(tiny_dir), *TINY, "--attention-heads", "--json", str(out)]
    assert main(args) == 0
    step = lmtrace.Trace.from_json(out.read_text()).to_dict()["steps"][1]
    heads = step["attention"]["layers"][0]["heads"]
    assert [h["head"] for h in heads] == list(range(len(heads))) and len(heads) > 1
    assert set(heads[0]) == {"head", "top", "sink_mass", "recent_mass", "entropy"}
    assert "lens" not in step


def test_generate_cli_refuses_compile_with_lens(capsys, tiny_dir):
    code = main(["generate", "Hi", "--model", str(tiny_dir), *TINY, "--lens", "--compile"])
    assert code == 2 and "compile" in capsys.readouterr().err


def test_branch_steps_carry_their_own_records(tiny_lm):
    result = branch(tiny_lm, "Hello world", 1, [2], max_new_tokens=4, temperature=0, top_logprobs=3,
                    lens=True, attention=True)  # fmt: skip
    original, other = result.traces
    plain = branch(tiny_lm, "Hello world", 1, [2], max_new_tokens=4, temperature=0, top_logprobs=3).traces[1]
    assert other.token_ids == plain.token_ids and [s.logprob for s in other.steps] == [s.logprob for s in plain.steps]
    fork, mine = original.steps[1], other.steps[1]  # the same forward, another chosen token
    assert [x["top"] for x in mine.lens["layers"]] == [x["top"] for x in fork.lens["layers"]]
    assert mine.lens["layers"][-1]["chosen_rank"] == mine.rank == 2
    assert mine.attention == fork.attention
    seq = other.prompt["token_ids"] + other.token_ids
    for step in other.steps[2:]:  # after the fork: positions name the branch's own tokens
        for layer in step.attention["layers"]:
            assert all(t["token_id"] == seq[t["position"]] for t in layer["top"])
        assert step.lens["layers"][-1]["chosen_logprob"] == step.logprob  # the final row: the step's own


def test_branch_cli_flags(tiny_dir, tmp_path):
    out = tmp_path / "b.json"
    args = ["branch", "Hello world", "--at", "1", "--model", str(tiny_dir), *TINY, "--lens", "--json", str(out)]
    assert main(args) == 0
    d = json.loads(out.read_text())
    assert all("lens" in s and "attention" not in s for b in d["branches"] for s in b["steps"])


def test_batch_cli_flags_and_per_line_override(tiny_dir, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": 1, "prompt": "Hello world"}, {"id": 2, "prompt": "Hello", "attention": False},
             {"id": 3, "prompt": "Hi", "lens": "yes"}, {"id": 4, "prompt": "Hi", "attention": "heads"}]  # fmt: skip
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["batch", str(src), str(out), "--model", str(tiny_dir), *TINY[:-1], "--lens", "--attention"]) == 0
    rec = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    _has_both(rec[1]["trace"]["steps"][0])
    assert "lens" in rec[2]["trace"]["steps"][0] and "attention" not in rec[2]["trace"]["steps"][0]
    assert rec[3]["error"] == "lens must be true or false, got 'yes'"
    assert "heads" in rec[4]["trace"]["steps"][0]["attention"]["layers"][0]


def test_traces_route_fields(tiny_lm):
    with TestClient(create_app(tiny_lm, name="tiny")) as client:
        body = {"prompt": "Hello world", "max_tokens": 3, "temperature": 0, "lens": True, "attention": True}
        d = client.post("/v1/traces", json=body).json()
        plain = client.post("/v1/traces", json={**body, "lens": False, "attention": False}).json()
        bad = client.post("/v1/traces", json={**body, "lens": "maybe"})
        per_head = client.post("/v1/traces", json={**body, "lens": False, "attention": "heads"}).json()
        bad_heads = client.post("/v1/traces", json={**body, "attention": "all"})
    for step in d["steps"]:
        _has_both(step)
    assert [s["logprob"] for s in d["steps"]] == [s["logprob"] for s in plain["steps"]]
    assert "lens" not in plain["steps"][0]
    assert bad.status_code == 400
    assert "heads" in per_head["steps"][0]["attention"]["layers"][0]
    assert [s["logprob"] for s in per_head["steps"]] == [s["logprob"] for s in plain["steps"]]
    assert bad_heads.status_code == 400


def test_render_lens_prints_a_layer_table(capsys, tiny_lm, tmp_path):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=3, temperature=0, lens=True, attention=True)
    path = tmp_path / "t.json"
    path.write_text(trace.to_json())
    assert main(["render", str(path), "--lens", "--step", "1", "--no-color"]) == 0
    out = capsys.readouterr().out
    settled = ", ".join(str(s.lens["settled_at"]) for s in trace.steps)
    assert f"settled at layer {settled}" in out
    assert "step 1:" in out and "looks at" in out and "sinks" in out
    assert out.count("\n  ") >= 3  # a row per layer
    assert main(["render", str(path), "--lens", "--step", "7"]) == 2
    assert "step must be in 0..2, got 7" in capsys.readouterr().err
    plain = tmp_path / "plain.json"
    plain.write_text(lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, temperature=0).to_json())
    assert main(["render", str(plain), "--lens"]) == 2
    assert "no lens or attention records" in capsys.readouterr().err


def _att_step(raw: dict[int, float], valued: dict[int, float]) -> dict:
    layer = {"layer": 0, "top": [{"position": p, "weight": w} for p, w in raw.items()],
             "value_weighted": {"top": [{"position": p, "weight": w} for p, w in valued.items()]}}  # fmt: skip
    return {"attention": {"layers": [layer]}}


def test_only_positions_that_behave_as_sinks_are_marked():
    """A 5-token prompt: position 0 takes most raw weight but little once weighted by its value
    (a sink); positions 1-3 ("capital of France") carry weight either way (no sinks)."""
    from lmtrace.render.html.inside import sink_positions

    steps = [_att_step({0: 0.6, 1: 0.1, 2: 0.15, 3: 0.15}, {0: 0.05, 1: 0.3, 2: 0.3, 3: 0.35})] * 3
    assert sink_positions(steps) == {0}
    assert sink_positions([_att_step({0: 0.6, 2: 0.4}, {0: 0.5, 2: 0.5})]) == set()  # its value matters
    assert sink_positions([_att_step({0: 0.9}, {})]) == set()  # no value-weighted record: nothing claimed


def test_recent_mass_only_past_its_window(tiny_lm):
    from lmtrace.render.html.trace import render_html

    short = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=3, temperature=0, attention=True)
    assert 'data-recent=""' in render_html(short)
    long = lmtrace.generate(tiny_lm, "Hello world " * 12, max_new_tokens=3, temperature=0, attention=True)
    assert 'data-recent="32"' in render_html(long)
