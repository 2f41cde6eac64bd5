"""Charts that read: byte axes never in e-notation, the lens heatmap's axis name clear of its
ticks with 'emb' and each step's token, probabilities in the panels as a person reads them, axes
below zero for a logprob change, and the KV lab page in the report's own style, with axes and
hover panels (headless Chromium, with a screenshot)."""

from __future__ import annotations

import base64
import re

import pytest

import lmtrace
from lmtrace.render.html.inside import lens_heatmap
from lmtrace.render.html.svg import Series, human_bytes, line_chart, nice_ticks
from lmtrace.render.html.trace import write_html
from tests.test_report_browser import BROWSER, hover, open_report, problems


def test_byte_ticks_are_never_in_e_notation():
    for top in (1000 * 1024, 999 * 1024, 1023 * 1024**2, 5000, 737_280):
        labels = [human_bytes(t) for t in nice_ticks(top, binary=True)]
        assert not any("e+" in label for label in labels) and all(len(label) <= 9 for label in labels), labels
    assert human_bytes(1000 * 1024) == "1000 KiB" and human_bytes(1536) == "1.5 KiB"


def test_a_logprob_change_is_drawn_below_zero():
    svg = str(line_chart([Series("window", [0.0, -3.2, -8.1, 1.4])], "change"))
    ticks = [float(t) for t in re.findall(r'class="tick" x="\d+" y="[\d.]+" text-anchor="end">(-?[\d.]+)<', svg)]
    assert min(ticks) <= -8.1 and max(ticks) >= 1.4 and 0.0 in ticks
    ys = [float(y) for y in re.findall(r'cy="([\d.]+)"', svg)]
    assert all(0 <= y <= 170 for y in ys)  # every point inside the chart


@pytest.fixture(scope="module")
def lensed(tiny_lm):
    return lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=6, temperature=0, lens=True, attention=True)


def test_lens_heatmap_axis_name_is_clear_of_the_ticks_and_names_the_tokens(lensed):
    svg = str(lens_heatmap(lensed.to_dict()["steps"]))
    name = re.search(r'<text class="tick axis" x="4" y="([\d.]+)">layer</text>', svg)
    found = re.findall(r'<text class="tick" x="40" y="([\d.]+)" text-anchor="end">(\w+)<', svg)
    ticks = sorted((float(y), t) for y, t in found)
    assert name and ticks and min(y for y, _ in ticks) - float(name.group(1)) >= 10  # no "layer30"
    assert ticks[0][1] == "2" and ticks[-1][1] == "emb"  # the final layer on top, the embeddings at the bottom
    tokens = re.findall(r'class="tick token"[^>]*>([^<]*)<', svg)
    assert len(tokens) == len(lensed.steps) and tokens[0] == lmtrace.render.tokens.escape(lensed.steps[0].text)[:10]


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_panel_probabilities_read_as_numbers(tmp_path):
    from tests.handmade import trace_dict

    d = trace_dict()
    d["steps"][1]["top"][1]["logprob"] = -30.8  # p = 4.2e-14
    report = tmp_path / "report.html"
    write_html(report, d)
    browser = open_report(report, tmp_path / "profile")
    try:
        hover(browser, '.tok[data-i="1"]')
        browser.wait_for("document.querySelectorAll('#panel table.alts').length > 0", timeout=10)
        cells = browser.js("[...document.querySelectorAll('#panel table.alts td.n')].map(c => c.textContent)")
        assert "< 0.0001" in cells and not any("e-" in c for c in cells)
        assert problems(browser) == []
    finally:
        browser.close()


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_kv_lab_page_shares_the_report_style_axes_and_panels(tiny_lm, tmp_path):
    from lmtrace.kvlab import kvlab
    from lmtrace.render.html.kvlab import write_lab_html

    lab = kvlab(tiny_lm, "Hello world, the quick brown fox", ["window:size=4", "streaming:sinks=1,window=3"],
                max_new_tokens=6, temperature=0)  # fmt: skip
    page = tmp_path / "lab.html"
    write_lab_html(page, lab)
    browser = open_report(page, tmp_path / "profile")
    try:
        assert browser.js("!!document.querySelector('header h1') && !!document.getElementById('panel')")
        assert browser.js("document.querySelectorAll('svg.chart text.tick').length") > 20  # axes with ticks
        token = '.text[data-v="2"] .tok[data-i="3"]'  # the second policy's fourth token
        browser.js(f"document.querySelector('{token}').scrollIntoView({{block: 'center'}}) || 1")
        hover(browser, token)
        browser.wait_for("document.getElementById('panel').textContent.includes('KL(full')", timeout=10)
        panel = browser.js("document.getElementById('panel').textContent")
        assert "streaming:sinks=1,window=3" in panel and "Δ logprob vs full" in panel
        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"})["data"])
        (tmp_path / "lab.png").write_bytes(shot)
        assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
        assert problems(browser) == []
    finally:
        browser.close()
