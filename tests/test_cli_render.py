"""`lmtrace render` and the report options of `generate`, in-process on the tiny model."""

from __future__ import annotations

import json
import struct

import pytest

from lmtrace.cli import main
from lmtrace.render.plots.trace import plot_png
from tests import handmade

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def decodes(path) -> bool:
    from matplotlib.image import imread

    return imread(path).ndim == 3


def test_generate_writes_reports_and_render_shows_the_same_view(capsys, tiny_dir, tmp_path):
    args = ["generate", "Hello world", "--model", str(tiny_dir), "--max-new-tokens", "6", "--temperature", "0.8"]
    args += ["--seed", "3", "--json", str(tmp_path / "t.json"), "--no-color"]
    assert main([*args, "--html", str(tmp_path / "g.html"), "--plot", str(tmp_path / "g.png")]) == 0
    generated = capsys.readouterr().out
    assert f"report written to {tmp_path / 'g.html'}" in generated
    assert f"plot written to {tmp_path / 'g.png'}" in generated
    html = (tmp_path / "g.html").read_text(encoding="utf-8")
    assert html.startswith("<!doctype html>") and '"kind":"trace"' in html
    assert png_size((tmp_path / "g.png").read_bytes())[0] > 100 and decodes(tmp_path / "g.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.html", "g.png", "t.json"]  # no temporary files

    # without options, render prints exactly the view generate printed
    assert main(["render", str(tmp_path / "t.json"), "--no-color"]) == 0
    rendered = capsys.readouterr().out
    assert rendered == generated.split("trace written to")[0] and "entropy" in rendered


def test_render_writes_reports_of_saved_files(capsys, tmp_path):
    for name, record in (
        ("trace", handmade.trace_dict(layers=True)),
        ("score", handmade.score_dict()),
        ("branches", handmade.branches_dict()),
    ):
        src = tmp_path / f"{name}.json"
        src.write_text(json.dumps(record), encoding="utf-8")
        html, png = tmp_path / f"{name}.html", tmp_path / f"{name}.png"
        assert main(["render", str(src), "--html", str(html), "--plot", str(png)]) == 0
        assert f'"kind":"{name}"' in html.read_text(encoding="utf-8")
        assert decodes(png)
        assert main(["render", str(src), "--no-color"]) == 0  # the terminal view of each kind
    out = capsys.readouterr().out
    assert "perplexity 3.21" in out and "branch 1" in out


BAD = [
    (lambda p: [str(p / "missing.json")], "trace: cannot read '{p}/missing.json' (No such file or directory)"),
    (lambda p: [str(p / "bad.json")], "trace: '{p}/bad.json' is not valid JSON (Expecting value: line 1 column 1"),
    (lambda p: [str(p / "v2.json")], "trace: '{p}/v2.json': schema_version must be 1, got 2"),
    (lambda p: [str(p / "other.json")], "trace: '{p}/other.json': not a trace (steps)"),
    (lambda p: [str(p / "v2.json"), "--plot", str(p / "x.jpg")], "plot: the file must end in .png, got '{p}/x.jpg'"),
    (lambda p: [str(p / "v2.json"), "--html", str(p / "no" / "r.html")], "html: no such folder '{p}/no'"),
]


@pytest.mark.parametrize("args,message", BAD, ids=["missing", "json", "schema", "shape", "suffix", "folder"])
def test_bad_input_exits_2_with_one_line_naming_the_file(capsys, tmp_path, args, message):
    (tmp_path / "bad.json").write_text("not json")
    d = handmade.trace_dict()
    d["schema_version"] = 2
    (tmp_path / "v2.json").write_text(json.dumps(d))
    (tmp_path / "other.json").write_text('{"hello": 1}')
    assert main(["render", *args(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmtrace: error: {message.format(p=tmp_path)}") and err.count("\n") == 1


def test_generate_checks_report_paths_before_loading(capsys, tmp_path):
    assert main(["generate", "Hi", "--model", str(tmp_path / "none"), "--plot", str(tmp_path / "a.svg")]) == 2
    assert "plot: the file must end in .png" in capsys.readouterr().err


def test_plot_png_of_each_kind():
    for record in (handmade.trace_dict(), handmade.score_dict(), handmade.branches_dict()):
        width, height = png_size(plot_png(record))
        assert width > 400 and height > 300


def test_render_a_score_without_perplexity(tmp_path, capsys):
    from lmtrace.cli import main

    f = tmp_path / "s.json"
    f.write_text(json.dumps({"tokens": [{"token_id": 5, "text": "Hi", "logprob": None}], "perplexity": None}))
    assert main(["render", str(f)]) == 0
    assert "perplexity – over 1 tokens" in capsys.readouterr().out


def test_score_and_branch_write_reports(tiny_dir, tmp_path):
    from lmtrace.cli import main

    s_html, b_html, b_png = tmp_path / "s.html", tmp_path / "b.html", tmp_path / "b.png"
    assert main(["score", "Hello world, the quick brown fox", "--model", str(tiny_dir), "--html", str(s_html)]) == 0
    assert "perplexity" in s_html.read_text()
    args = ["branch", "Hello world", "--at", "2", "--alternative", "2", "--max-new-tokens", "5", "--temperature", "0"]
    assert main([*args, "--model", str(tiny_dir), "--html", str(b_html), "--plot", str(b_png)]) == 0
    assert "Branches" in b_html.read_text() and b_png.read_bytes()[:4] == b"\x89PNG"
