"""The KV anatomy as a person reads it (report and terminal): each dimension with its value and
config field, the formula with its numbers and result, "none" for empty lists, an alert only
on a mismatch; and the report's anatomy laid out in headless Chromium, with a screenshot."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
from transformers import Gemma2Config

import lmtrace
from lmtrace.kv import size as kvsize
from lmtrace.render import anatomy
from lmtrace.render.html.trace import write_html
from tests.server.cdp import find_browser


@pytest.fixture(scope="module")
def trace(tiny_lm):
    return lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=5, temperature=0)


def test_each_dimension_has_its_value_and_config_field(trace):
    an = trace.kv_anatomy
    positions, measured = anatomy.last_kv(trace.to_dict()["steps"])
    dims = {d.name: (d.value, d.source) for d in anatomy.dimensions(an, positions)}
    assert dims["layers"] == ("2", "num_hidden_layers")
    assert dims["KV heads"] == ("2", "num_key_value_heads; 4 query heads share them: GQA (group size 2)")
    assert dims["head_dim"] == ("16", "hidden_size / num_attention_heads = 64 / 4")
    assert dims["positions"][0] == str(positions) and dims["bytes per element"] == ("4", "dtype float32")
    assert dims["sliding-window layers"] == ("none", "every layer keeps every position")
    f = anatomy.formula(an, positions, measured)
    assert f.numbers == f"2 × 2 × 2 × 16 × 4 × 1 × {positions}"
    expected = 2 * 2 * 2 * 16 * 4 * positions
    assert f.result.startswith(f"{expected:,} bytes") and measured == expected
    page = anatomy.html(an, positions, measured)
    assert "[]" not in page and "sources." not in page and "anatomy-alert" not in page
    text = plain(anatomy.terminal(an, "tiny", positions, measured))
    assert "num_key_value_heads" in text and "none" in text and "[]" not in text and "error" not in text
    assert f"= 2 × 2 × 2 × 16 × 4 × 1 × {positions}" in text


def test_a_mismatch_is_an_alert_and_model_text_is_escaped(trace):
    an = {**trace.kv_anatomy, "mismatches": [3, 4], "dtype": "<b>float32</b>"}
    page = anatomy.html(an, 7, 123)
    assert 'role="alert">The measured KV cache differs from the formula at steps 3, 4<' in page
    assert "<b>float32" not in page and "&lt;b&gt;float32" in page
    assert "error: The measured KV cache differs from the formula at steps 3, 4" in plain(anatomy.terminal(an, "m", 7))


def test_sliding_window_layers_are_named_and_counted():
    config = Gemma2Config(num_hidden_layers=4, sliding_window=8, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=300)  # fmt: skip
    an = kvsize.anatomy(config).to_dict()
    dims = {d.name: (d.value, d.source) for d in anatomy.dimensions(an, 20)}
    assert dims["sliding-window layers"] == ("2 of 4", "layers 0, 2; window 8: they hold window − 1 = 7 positions")
    f = anatomy.formula(an, 20)
    assert f.numbers == "2 × 2 × 16 × 4 × 1 × (2 × 20 + 2 × 7)"
    assert f.result.startswith(f"{kvsize.anatomy(config).bytes_at(20):,} bytes")  # the calculator agrees


def test_the_cache_command_shows_the_reading(tiny_dir, capsys):
    from lmtrace.cli import main

    assert main(["cache", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "3", "--temperature", "0",
                 "--no-color"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "head_dim" in out and "hidden_size / num_attention_heads = 64 / 4" in out
    assert "= 2 × 2 × 2 × 16 × 4 × 1 × 4" in out and "sliding-window layers" in out and "[]" not in out


BROWSER = find_browser()
LAYOUT = """JSON.stringify((() => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; };
  const section = document.querySelector('section#kv');
  const rows = [...section.querySelectorAll('.anatomy-dims tbody tr')];
  return {
    section: box(section),
    rows: rows.map(r => [...r.children].map(c => [c.textContent, box(c)])),
    formula: [...section.querySelectorAll('.anatomy-formula code')].map(c => [c.textContent, box(c)]),
    alert: [...section.querySelectorAll('.anatomy-alert')].map(a => [a.textContent, box(a)]),
    text: section.innerText,
    scroll: window.scrollY,
  };
})())"""


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_the_report_anatomy_in_chromium(trace, tmp_path):
    from tests.test_report_browser import open_report, problems

    clean, broken = tmp_path / "clean.html", tmp_path / "broken.html"
    write_html(clean, trace)
    d = trace.to_dict()
    d["kv_anatomy"] = {**d["kv_anatomy"], "mismatches": [2]}
    write_html(broken, lmtrace.Trace.from_dict(d))
    browser = open_report(clean, tmp_path / "profile")
    try:
        browser.js("document.querySelector('section#kv').scrollIntoView()")
        page = json.loads(browser.js(LAYOUT))
        names = [row[0][0] for row in page["rows"]]
        assert names == ["layers", "KV heads", "head_dim", "batch", "positions", "bytes per element",
                         "sliding-window layers"]  # fmt: skip
        left, right = page["section"][0], page["section"][0] + page["section"][2]
        for row in page["rows"]:
            assert len(row) == 3 and all(cell[1][2] > 0 and cell[1][3] > 0 for cell in row)  # laid out, visible
            assert all(left <= cell[1][0] and cell[1][0] + cell[1][2] <= right + 1 for cell in row)  # inside
            assert row[0][1][1] == row[1][1][1] == row[2][1][1]  # a dimension, its value, its field: one line
        assert [f[0] for f in page["formula"]][1].startswith("= 2 × 2 × 2 × 16 × 4 × 1 × ")
        assert all(f[1][3] > 0 for f in page["formula"]) and page["alert"] == []
        assert "[]" not in page["text"] and "sources." not in page["text"]
        x, y, width, height = page["section"]
        clip = {"x": x, "y": y + page["scroll"], "width": width, "height": min(height, 1200), "scale": 1}
        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png", "clip": clip})["data"])
        (tmp_path / "anatomy.png").write_bytes(shot)  # LMTRACE_SHOTS=DIR keeps a copy to look at
        if os.environ.get("LMTRACE_SHOTS"):
            (Path(os.environ["LMTRACE_SHOTS"]) / "anatomy.png").write_bytes(shot)
        assert shot.startswith(b"\x89PNG") and len(shot) > 5_000
        browser.send("Page.navigate", {"url": broken.as_uri()})
        browser.wait_for("document.readyState === 'complete' && !!document.querySelector('.anatomy-alert')")
        alert = json.loads(browser.js(LAYOUT))["alert"]
        assert alert[0][0] == "The measured KV cache differs from the formula at step 2" and alert[0][1][3] > 0
        assert problems(browser) == []
    finally:
        browser.close()


def plain(renderable) -> str:
    """A rich renderable as the text a wide terminal shows."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=200, no_color=True)
    console.print(renderable)
    return console.file.getvalue()
