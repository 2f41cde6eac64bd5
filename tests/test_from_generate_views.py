"""A trace of model.generate goes everywhere a trace goes: `lmtrace render` (terminal, --html,
--plot), the notebook view, `lmtrace compare` (as an engine response), rescore; with one
distribution missing nothing shows "nan" or crashes."""

from __future__ import annotations

import json

import pytest

import lmtrace
from lmtrace.cli import main
from lmtrace.render.html.trace import page_data

FLAGS = {
    "both": {"output_scores": True, "output_logits": True},
    "raw": {"output_logits": True},
    "processed": {"output_scores": True},
}


def generated(lm, which: str, **gen):
    ids = lm.tokenizer("Hello world, the", return_tensors="pt")
    settings = {"do_sample": False, "max_new_tokens": 8, **gen}
    out = lm.model.generate(**ids, **settings, return_dict_in_generate=True, **FLAGS[which])
    return lmtrace.from_generate(out, lm.tokenizer, model=lm.model, generation_config=settings)[0]


@pytest.mark.parametrize("which", ["both", "raw", "processed"])
def test_render_cli_terminal_html_plot(tiny_lm, tmp_path, capsys, which):
    trace = generated(tiny_lm, which, repetition_penalty=1.3)
    src = tmp_path / "t.json"
    src.write_text(trace.to_json(), encoding="utf-8")
    html, png = tmp_path / "t.html", tmp_path / "t.png"
    assert main(["render", str(src), "--html", str(html), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    page = html.read_text(encoding="utf-8")
    assert "model.generate (from_generate)" in page
    words = {"both": "raw and processed", "raw": "raw only", "processed": "processed only"}[which]
    assert words in page and "nan" not in page.lower() and "None" not in page
    assert "By layer, when model.generate returned (the whole batch)" in page  # the final ledger, not per step
    data = page_data(page)
    colours = [s["r"] for s in data["views"][0]["steps"]]
    assert all(c >= 0 for c in colours)  # every token coloured, by what the trace holds
    assert main(["render", str(src), "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "from model.generate" in out and "nan" not in out.lower() and "None" not in out
    if which == "processed":
        assert "processed distribution only" in out
    nb = trace._repr_html_()
    assert "nan" not in nb.lower() and "None" not in nb


def test_compare_reads_it_as_an_engine_response(tiny_lm, tmp_path, capsys):
    trace = generated(tiny_lm, "both")
    result = lmtrace.compare(tiny_lm, trace.to_dict())
    assert result.kind == "lmtrace" and result.summary["verdict"] == "raw"
    assert result.summary["compared"] == len(trace.steps) and result.summary["max_abs_diff"] < 1e-4
    processed = generated(tiny_lm, "processed", do_sample=True, temperature=0.5, top_k=0)
    told = lmtrace.compare(tiny_lm, processed.to_dict(), temperature=0.5)
    assert told.summary["verdict"] == "processed" and told.summary["mean_abs_diff_processed"] < 1e-4


def test_compare_cli_on_a_saved_trace(tiny_dir, tmp_path, capsys):
    lm = lmtrace.load(str(tiny_dir))
    src = tmp_path / "g.json"
    src.write_text(generated(lm, "raw").to_json(), encoding="utf-8")
    assert main(["compare", str(src), "--model", str(tiny_dir), "--json", str(tmp_path / "c.json")]) == 0
    summary = json.loads((tmp_path / "c.json").read_text())["summary"]
    assert summary["verdict"] == "raw" and summary["max_abs_diff"] < 1e-4


def test_rescore_with_and_without_settings(tiny_lm):
    with_settings = lmtrace.rescore(tiny_lm, generated(tiny_lm, "both", repetition_penalty=1.3))
    assert with_settings["max_abs_diff"] < 1e-4 and with_settings["max_abs_diff_sampled"] < 1e-4
    ids = tiny_lm.tokenizer("Hello world, the", return_tensors="pt")
    out = tiny_lm.model.generate(**ids, do_sample=False, max_new_tokens=5, return_dict_in_generate=True,
                                 output_scores=True)  # fmt: skip
    bare = lmtrace.from_generate(out, tiny_lm.tokenizer)[0]  # no model, no settings: none are guessed
    assert bare.params["settings"] == "unknown" and bare.model["config"] == {}
    r = lmtrace.rescore(tiny_lm, bare)
    assert r["max_abs_diff"] is None and r["max_abs_diff_sampled"] is None and r["rank_mismatches"] == 0
