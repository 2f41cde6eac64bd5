"""The HTML report in headless Chromium (skipped without a Chromium; `make test` installs
Debian's where it can): hover a token, the panel shows its alternatives; no console error, no
network request, no dialog; the payload stays text; a screenshot."""

from __future__ import annotations

import base64
import json

import pytest

import lmtrace
from lmtrace.render.html.trace import write_html
from tests.server.cdp import Browser, find_browser

BROWSER = find_browser()
PAYLOAD = "</script><img src=x onerror=alert(1)>"
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")


def open_report(path, profile) -> Browser:
    browser = Browser(BROWSER, str(profile))
    browser.open("about:blank")
    for domain in ("Runtime", "Log", "Network", "Page"):
        browser.send(f"{domain}.enable")
    browser.send("Page.navigate", {"url": path.as_uri()})
    browser.wait_for("document.readyState === 'complete' && !!document.getElementById('panel')")
    return browser


def hover(browser: Browser, selector: str) -> None:
    rect = f"document.querySelector({json.dumps(selector)}).getBoundingClientRect()"
    box = json.loads(browser.js(f"JSON.stringify({rect})"))
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})


def problems(browser: Browser) -> list[str]:
    """Console errors, exceptions, dialogs and any request that left the page."""
    found = []
    for e in browser.events:
        m, p = e["method"], e.get("params", {})
        if m == "Runtime.exceptionThrown" or m == "Page.javascriptDialogOpening":
            found.append(m)
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            found.append(f"console {p.get('type')}")
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            found.append(f"log: {p['entry'].get('text')}")
        elif m == "Network.requestWillBeSent":
            url = p.get("request", {}).get("url", "")
            if not url.startswith(("file:", "data:", "about:")):
                found.append(f"request {url}")
    return found


def test_hover_shows_the_alternatives_and_nothing_leaves_the_page(tiny_lm, tmp_path):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=12, temperature=0.8, seed=2, top_logprobs=5)
    report = tmp_path / "report.html"
    write_html(report, trace)
    browser = open_report(report, tmp_path / "profile")
    try:
        hover(browser, '.tok[data-i="3"]')
        browser.wait_for("document.querySelectorAll('#panel h4').length > 0", timeout=10)
        panel = browser.js("document.getElementById('panel').textContent")
        assert "alternatives" in panel
        shown = browser.js("[...document.querySelectorAll('#panel .panel-token')].map(e => e.textContent)")
        assert shown, "the hovered token is shown in the panel"
        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"})["data"])
        (tmp_path / "report.png").write_bytes(shot)
        assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
        assert problems(browser) == []
    finally:
        browser.close()


def test_model_text_payload_is_shown_and_never_runs(tmp_path):
    from tests.handmade import trace_dict

    d = trace_dict()  # the payload is a token, an alternative, the model's name, the prompt, a stop string
    report = tmp_path / "payload.html"
    write_html(report, d)
    browser = open_report(report, tmp_path / "profile")
    try:
        hover(browser, '.tok[data-i="3"]')  # the payload token: its panel lists payload alternatives too
        browser.wait_for("document.querySelectorAll('#panel h4').length > 0", timeout=10)
        assert PAYLOAD in browser.js("document.body.textContent")
        assert browser.js("document.querySelectorAll('img').length") == 0
        assert problems(browser) == []
    finally:
        browser.close()
