"""`lmtrace stability` in-process on the tiny model: JSON in the contract's shape, the terminal
view, the HTML report (escaped, no script) and the plot; bad input is one line and exit 2, before
any model loads; a variant that cannot run here is reported skipped, not an error."""

from __future__ import annotations

import json

import pytest

from lmtrace.cli import main
from tests.same_record import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_stability_writes_json_html_plot_and_the_terminal_view(capsys, tiny_dir, tmp_path):
    paths = {k: tmp_path / f"s.{k}" for k in ("json", "html", "png")}
    prompt = "<script>alert(1)</script> Once upon a time"
    code, out, err = run(capsys, "stability", prompt, "--model", tiny_dir, "--variant", "dtype:bf16",
                         "--variant", "batch:2", "--variant", "weights:packed", "--max-new-tokens", 6,
                         "--runs", 2, "--threshold", 1e6, "--json", paths["json"], "--html", paths["html"],
                         "--plot", paths["png"], "--no-color")  # fmt: skip
    assert code == 0, err
    d = json.loads(paths["json"].read_text())
    assert d["kind"] == "stability" and len(d["reference"]["steps"]) == 6 and d["threshold"] == 1e6
    assert [v["variant"] for v in d["variants"]] == ["dtype:bfloat16", "batch:2", "weights:packed"]
    for v in d["variants"][:2]:
        assert v["status"] == "ran" and len(v["steps"]) == 6
        assert {"index", "logprob", "delta", "flipped"} <= set(v["steps"][0])
        assert {"first_divergence", "max_abs_delta", "mean_abs_delta", "flips"} <= set(v)
    assert d["variants"][2]["status"] == "skipped" and ".gguf" in d["variants"][2]["reason"]
    assert [s["index"] for s in d["steps"]] == list(range(6))
    assert all(s["flagged"] for s in d["steps"])  # a huge threshold flags every step with any noise
    assert len(d["runs"]) == 1 and d["runs"][0]["identical"]
    assert "dtype:bfloat16" in out and "Flagged tokens" in out and "weights:packed skipped" in out
    html = paths["html"].read_text()
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html and "<script" not in html
    assert "<svg" in html and "Flagged tokens" in html and "skipped:" in html
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, again, err = run(capsys, "render", paths["json"], "--no-color")  # a saved ledger, shown again
    assert code == 0 and "Flagged tokens" in again and "dtype:bfloat16" in again, err
    code, _, err = run(capsys, "render", paths["json"], "--html", tmp_path / "again.html")
    assert code == 0 and (tmp_path / "again.html").read_text() == html, err


def test_json_to_stdout_keeps_the_view_on_stderr(capsys, tiny_dir):
    code, out, err = run(capsys, "stability", "Hello", "--model", tiny_dir, "--variant", "attention:eager",
                         "--max-new-tokens", 3, "--json", "-")  # fmt: skip
    assert code == 0, err
    d = json.loads(out)
    assert d["variants"][0]["variant"] == "attention:eager" and "attention:eager" in err


@pytest.mark.parametrize("args,words", [
    (["--variant", "fp8"], ["variant", "'fp8'"]),
    (["--variant", "dtype:int4"], ["variant", "dtype:int4"]),
    (["--variant", "batch:one"], ["variant", "batch:one"]),
    (["--variant", "threads:2", "--variant", "threads:2"], ["variant", "twice"]),
    (["--runs", "0"], ["runs", "0"]),
    (["--threshold", "-1"], ["threshold", "-1"]),
    (["--temperature", "-1"], ["temperature", "-1"]),
    (["--plot", "out.svg"], ["plot", "out.svg"]),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2_before_loading(capsys, tmp_path, args, words):
    code, _, err = run(capsys, "stability", "Hello", "--model", tmp_path / "never-loaded", *args)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and line.startswith("lmtrace: error:") and all(w in line for w in words), line
