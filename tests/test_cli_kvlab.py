"""`lmtrace kv-lab` in-process on the tiny model: JSON in the contract's shape, the HTML report
(escaped), the plot, and one-line errors with exit 2 for bad specs."""

from __future__ import annotations

import json

import pytest

from lmtrace.cli import main


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_kv_lab_writes_json_html_and_plot(capsys, tiny_dir, tmp_path):
    paths = {k: tmp_path / f"lab.{k}" for k in ("json", "html", "png")}
    prompt = "<script>alert(1)</script> Hello world"
    code, out, err = run(capsys, "kv-lab", prompt, "--model", tiny_dir, "--policy", "streaming:sinks=2,window=4",
                         "--policy", "h2o:budget=0.25", "--policy", "fp8", "--max-new-tokens", 6,
                         "--json", paths["json"], "--html", paths["html"], "--plot", paths["png"],
                         "--free")  # fmt: skip
    assert code == 0, err
    d = json.loads(paths["json"].read_text())
    assert [a["policy"] for a in d["arms"]] == ["streaming:sinks=2,window=4", "h2o:budget=0.25,recent=0.5", "fp8"]
    assert len(d["reference"]["steps"]) == 6 and all(len(a["steps"]) == 6 for a in d["arms"])
    for a in d["arms"]:
        assert {"bytes_fraction", "mean_kl", "max_kl", "top1_agreement", "perplexity", "divergence_step"} <= set(
            a["summary"]
        )
    assert "streaming:sinks=2,window=4" in out and "perplexity" in out
    html = paths["html"].read_text()
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html
    assert "<svg" in html and "What each policy kept" in html
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_lab_continuation_file(capsys, tiny_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" the quick brown fox jumps over the lazy dog.", encoding="utf-8")
    code, out, err = run(capsys, "kv-lab", "Once", "--model", tiny_dir, "--policy", "window:size=4",
                         "--continuation-file", text, "--json", "-")  # fmt: skip
    assert code == 0, err
    d = json.loads(out)
    assert d["teacher_forced"] and d["reference"]["text"] == text.read_text()


@pytest.mark.parametrize("args,words", [
    (["--policy", "streaming:sinks=-1"], ["streaming", "sinks"]),
    (["--policy", "h2o:budget=0"], ["h2o", "budget"]),
    (["--policy", "window:size"], ["window", "size"]),
    ([], ["policy"]),
])  # fmt: skip
def test_bad_specs_exit_2_with_one_line(capsys, tmp_path, args, words):
    code, _, err = run(capsys, "kv-lab", "Hello", "--model", tmp_path / "never-loaded", *args)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and all(w in line for w in words)
