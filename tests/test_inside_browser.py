"""The lens heatmap and the attention text in headless Chromium: hovering a heatmap cell shows
that layer's top tokens and shades the text by that step's attention; the layer selector
changes the shading; model text stays text; nothing leaves the page."""

from __future__ import annotations

import json

import pytest

import lmtrace
from lmtrace.render.html.inside import sink_positions
from lmtrace.render.html.trace import render_html, write_html
from lmtrace.render.tokens import escape as visible
from tests.test_report_browser import BROWSER, PAYLOAD, hover, open_report, problems

pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")


@pytest.fixture(scope="module")
def seen(tiny_lm):
    return lmtrace.generate(tiny_lm, "Hello world, the quick brown fox", max_new_tokens=8, temperature=0,
                            top_logprobs=3, lens=True, attention=True)  # fmt: skip


def test_heatmap_hover_and_attention_shading(seen, tmp_path):
    report = tmp_path / "report.html"
    write_html(report, seen)
    browser = open_report(report, tmp_path / "profile")
    try:
        hover(browser, 'rect[data-i="4"][data-l="1"]')
        browser.wait_for("document.getElementById('panel').textContent.includes('logit lens')", timeout=10)
        here = browser.js("document.querySelector('#panel table.lens tr.here td').textContent")
        assert here == "1"  # the hovered layer's row
        want = seen.steps[4].lens["layers"][1]["top"][0]["text"]
        assert "layer 1 top tokens" in browser.js("document.getElementById('panel').textContent")
        first = browser.js("document.querySelector('#panel table.alts:last-of-type td.t').textContent")
        assert first == visible(want)
        boxes = "[...document.querySelectorAll('.att-text .pos')]"
        positions = browser.js(boxes + ".filter(b => b.style.background).map(b => +b.dataset.pos)")
        layer = seen.steps[4].attention["layers"][-1]  # the selector starts at the last layer
        # value-weighted by default; the raw weights a toggle away
        assert sorted(positions) == sorted(t["position"] for t in layer["value_weighted"]["top"])
        browser.js("(() => { const r = document.querySelector('input[name=\"att-weights\"][value=\"raw\"]');"
                   " r.checked = true; r.dispatchEvent(new Event('change')); return 1; })()")  # fmt: skip
        positions = browser.js(boxes + ".filter(b => b.style.background).map(b => +b.dataset.pos)")
        assert sorted(positions) == sorted(t["position"] for t in layer["top"])
        query = len(seen.prompt["token_ids"]) + 3
        assert browser.js(f"document.querySelector('.att-text .pos[data-pos=\"{query}\"]').classList.contains('query')")
        marked = browser.js("[...document.querySelectorAll('.att-text .pos.sink')].map(b => +b.dataset.pos)")
        assert set(marked) == sink_positions(seen.to_dict()["steps"])
        browser.js("(() => { const s = document.getElementById('att-layer'); s.value = '0';"
                   " s.dispatchEvent(new Event('change')); return 1; })()")  # fmt: skip
        note = browser.js("document.getElementById('att-note').textContent")
        assert "layer 1, raw weights" in note and "sink mass" in note and "last-32" not in note
        assert "settled at layer" in browser.js("[...document.querySelectorAll('#steps th')].map(h => h.textContent)")
        assert problems(browser) == []
    finally:
        browser.close()


def test_head_selector_shades_by_one_heads_weights(tiny_lm, tmp_path):
    trace = lmtrace.generate(tiny_lm, "Hello world, the quick brown fox", max_new_tokens=6, temperature=0,
                             top_logprobs=3, attention="heads")  # fmt: skip
    report = tmp_path / "report.html"
    write_html(report, trace)
    browser = open_report(report, tmp_path / "profile")
    try:
        hover(browser, '.tok[data-i="4"]')
        browser.js("(() => { for (const [id, v] of [['att-layer', '0'], ['att-head', '1']]) {"
                   " const s = document.getElementById(id); s.value = v; s.dispatchEvent(new Event('change')); }"
                   " return 1; })()")  # fmt: skip
        boxes = "[...document.querySelectorAll('.att-text .pos')]"
        positions = browser.js(boxes + ".filter(b => b.style.background).map(b => +b.dataset.pos)")
        head = trace.steps[4].attention["layers"][0]["heads"][1]
        assert sorted(positions) == sorted(t["position"] for t in head["top"])
        assert "layer 1, head 1" in browser.js("document.getElementById('att-note').textContent")
        assert problems(browser) == []
    finally:
        browser.close()


def test_attention_text_is_shaded_before_any_hover(seen, tmp_path):
    report = tmp_path / "report.html"
    write_html(report, seen)
    browser = open_report(report, tmp_path / "profile")
    try:
        boxes = "[...document.querySelectorAll('.att-text .pos')]"
        shaded = browser.js(boxes + ".filter(b => b.style.background).map(b => +b.dataset.pos)")
        last = seen.steps[-1].attention["layers"][-1]["value_weighted"]["top"]
        assert sorted(shaded) == sorted(t["position"] for t in last)
        assert browser.js("document.getElementById('att-note').textContent").startswith(f"step {len(seen.steps) - 1} ")
        options = browser.js("[...document.querySelectorAll('#att-layer option')].map(o => o.textContent)")
        layers = len(seen.steps[0].attention["layers"])
        assert options == ["mean of the layers", *[str(k + 1) for k in range(layers)]]  # as the lens numbers them
        assert problems(browser) == []
    finally:
        browser.close()


def test_head_selector_only_with_per_head_records(seen):
    assert 'id="att-head"' not in render_html(seen)


def _poisoned(seen) -> dict:
    d = seen.to_dict()
    d["prompt"]["tokens"][0] = PAYLOAD
    for step in d["steps"]:
        step["lens"]["layers"][0]["top"][0]["text"] = PAYLOAD
        step["attention"]["layers"][0]["top"][0]["text"] = PAYLOAD
    return d


def test_model_text_in_the_new_panels_stays_text(seen, tmp_path):
    report = tmp_path / "payload.html"
    write_html(report, _poisoned(seen))
    assert PAYLOAD not in report.read_text()  # escaped in the markup and in the embedded JSON
    browser = open_report(report, tmp_path / "profile")
    try:
        hover(browser, 'rect[data-i="2"][data-l="0"]')
        browser.wait_for("document.getElementById('panel').textContent.includes('logit lens')", timeout=10)
        shown = PAYLOAD.replace(" ", "␣")  # whitespace made visible, as in every token
        assert shown in browser.js("document.querySelector('.att-text').textContent")
        assert shown in browser.js("document.getElementById('panel').textContent")
        assert browser.js("document.querySelectorAll('img').length") == 0
        assert problems(browser) == []
    finally:
        browser.close()


def test_notebook_view_has_the_heatmap(seen):
    page = seen._repr_html_()
    assert "<svg class=\"heatmap\"" in page and "settled at layer" in page and "<script" not in page
    poisoned = lmtrace.Trace.from_dict(_poisoned(seen))._repr_html_()
    assert PAYLOAD not in poisoned and "&lt;/script&gt;" in poisoned
    assert json.dumps(PAYLOAD) not in render_html(_poisoned(seen))
