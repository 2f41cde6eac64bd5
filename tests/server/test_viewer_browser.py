"""The viewer page in headless Chromium (skipped without a Chromium): type a prompt, generate,
hover a token for its alternatives, and take a screenshot."""

from __future__ import annotations

import base64
import json

import pytest

from lmtrace.server import create_app
from tests.server.cdp import Browser, find_browser
from tests.server.conftest import RunningServer

BROWSER = find_browser()


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_generate_and_hover_in_the_viewer(chat_lm, tmp_path):
    with RunningServer(create_app(chat_lm, name="tiny")) as server:
        browser = Browser(BROWSER, str(tmp_path / "profile"))
        try:
            browser.open(server.url + "/")
            browser.js(
                "document.getElementById('prompt').value = 'Once upon a time';"
                "document.getElementById('max_tokens').value = '12';"
                "document.getElementById('go').click();"
            )
            browser.wait_for("document.getElementById('status').textContent.startsWith('finish:')")
            assert browser.js("document.querySelectorAll('#out span').length") == 12
            assert browser.js("document.getElementById('status').className") == ""
            rects = "[...document.querySelectorAll('#out span')].map(s => s.getBoundingClientRect())"
            widest = f"{rects}.sort((a, b) => b.width - a.width)[0]"
            box = json.loads(browser.js(f"JSON.stringify({widest})"))
            x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
            browser.wait_for("document.getElementById('tip').style.display === 'block'", timeout=5)
            tip = browser.js("document.getElementById('tip').textContent")
            assert "alternatives:" in tip and "rank" in tip and "kv" in tip
            assert "\ufffd" not in tip, tip  # bytes that are not whole characters read <0xNN>, as in the report
            assert browser.js("document.getElementById('chart').toDataURL().length") > 1000  # the KV chart is drawn
            shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"})["data"])
            (tmp_path / "viewer.png").write_bytes(shot)
            assert shot.startswith(b"\x89PNG")
        finally:
            browser.close()
