"""The viewer page with the logit lens and attention asked for (headless Chromium): the
heatmap grows a column per streamed step, a cell's tip lists that layer's top tokens, and
hovering a token shades the prompt + generated text by its attention."""

from __future__ import annotations

import json
import re

import pytest

from lmtrace.server import create_app
from tests.server.cdp import Browser, find_browser
from tests.server.conftest import RunningServer

BROWSER = find_browser()


def _hover(browser: Browser, selector: str) -> None:
    rect = f"document.querySelector({json.dumps(selector)}).getBoundingClientRect()"
    box = json.loads(browser.js(f"JSON.stringify({rect})"))
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_viewer_lens_and_attention(chat_lm, tmp_path):
    with RunningServer(create_app(chat_lm, name="tiny")) as server:
        browser = Browser(BROWSER, str(tmp_path / "profile"))
        try:
            browser.open(server.url + "/")
            assert browser.js("document.getElementById('inside').style.display") == ""  # hidden by the stylesheet
            browser.js(
                "document.getElementById('prompt').value = 'Once upon a time';"
                "document.getElementById('max_tokens').value = '6';"
                "document.getElementById('lens_on').checked = true;"
                "document.getElementById('attention_on').checked = true;"
                "document.getElementById('go').click();"
            )
            browser.wait_for("document.getElementById('status').textContent.startsWith('finish:')")
            assert browser.js("document.querySelectorAll('#lens div').length") == 6 * 3  # 6 steps, 3 layers
            assert browser.js("document.querySelectorAll('#lens div.settled').length") <= 6
            # readable at its size: cells of 18 x 12 px, a layer axis (emb, 1, 2) and each step's token below
            size = browser.js("JSON.stringify(document.querySelector('#lens div').getBoundingClientRect())")
            assert json.loads(size)["width"] >= 16 and json.loads(size)["height"] >= 10
            ys = browser.js("[...document.querySelectorAll('#lens span.y')].map(s => s.textContent)")
            assert ys == ["emb", "1", "2", "step"]
            assert browser.js("document.querySelectorAll('#lens span.x').length") == 6
            # shaded at once by the last step, value-weighted, in the lens's numbering of layers
            shaded = "[...document.querySelectorAll('#att-text span')].filter(s => s.style.background).length"
            assert browser.js(shaded) > 0
            assert browser.js("document.getElementById('att-note').textContent").startswith("step 5, value-weighted")
            options = browser.js("[...document.querySelectorAll('#att-layer option')].map(o => o.textContent)")
            assert options == ["mean of the layers", "1", "2"]
            _hover(browser, '#lens div[data-step="2"][data-layer="1"]')
            browser.wait_for("document.getElementById('tip').style.display === 'block'", timeout=5)
            assert re.match(r'step 2 ".*" layer 1\n', browser.js("document.getElementById('tip').textContent"))
            _hover(browser, '#out span[data-step="3"]')
            browser.wait_for("document.getElementById('att-note').textContent.startsWith('step 3, value-weighted, "
                             "layer 2')", timeout=5)  # fmt: skip
            assert "last-32" not in browser.js("document.getElementById('att-note').textContent")  # 10 positions
            assert browser.js("document.querySelectorAll('#att-text span.sink').length") <= 1
            assert browser.js("document.querySelectorAll('#att-text span.query').length") == 1
        finally:
            browser.close()


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_viewer_without_the_options_shows_no_panels(chat_lm, tmp_path):
    with RunningServer(create_app(chat_lm, name="tiny")) as server:
        browser = Browser(BROWSER, str(tmp_path / "profile"))
        try:
            browser.open(server.url + "/")
            browser.js("document.getElementById('max_tokens').value = '3'; document.getElementById('go').click();")
            browser.wait_for("document.getElementById('status').textContent.startsWith('finish:')")
            assert browser.js("getComputedStyle(document.getElementById('inside')).display") == "none"
        finally:
            browser.close()
