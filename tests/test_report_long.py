"""A 2,048-step report (a synthetic trace of the bundled model's shape, lens and attention, no
model run): its size per step, and in headless Chromium that it opens without parsing its steps
(a broken step's line harms only that step), a token's panel built when clicked, and the painted
lens heatmap answering the pointer."""

from __future__ import annotations

import json
import time

import pytest

from lmtrace.render.html.trace import render_html
from tests.long_trace import long_trace
from tests.test_report_browser import BROWSER, open_report, problems

STEPS = 2048
BROKEN = 1000  # the step whose line the test breaks: nothing may read it before it is opened


@pytest.fixture(scope="module")
def page() -> str:
    return render_html(long_trace(STEPS, inside=True))


def test_size_per_step(page):
    per_step = len(page.encode()) / STEPS
    assert per_step < 20 * 1024, per_step  # 26 KB before the steps' data and the heatmap were made lazy
    assert page.count("<rect ") < 50 and 'class="heatmap painted"' in page  # cells as paths, not an element each


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_opens_without_parsing_the_steps_and_builds_a_panel_when_asked(page, tmp_path):
    start = page.index('id="lmtrace-steps-0">') + len('id="lmtrace-steps-0">')
    lines = page[start:page.index("</script>", start)].split("\n")
    lines[BROKEN] = "{"  # not JSON: only opening this step may fail
    report = tmp_path / "long.html"
    report.write_text(page[:start] + "\n".join(lines) + page[page.index("</script>", start):], encoding="utf-8")
    began = time.perf_counter()
    browser = open_report(report, tmp_path / "profile")
    try:
        opened = time.perf_counter() - began
        assert browser.js("document.querySelectorAll('.text .tok').length") == STEPS
        assert problems(browser) == []  # the broken line was never parsed
        browser.js("(() => { document.querySelector('.text .tok[data-i=\"1500\"]').click(); return 1; })()")
        browser.wait_for("document.querySelector('#panel h3').textContent === 'step 1500'", timeout=20)
        browser.js("(() => { document.querySelector('.text .tok[data-i=\"1500\"]').click(); return 1; })()")  # unpin
        _point_at_cell(browser, 700, 5)
        browser.wait_for("document.querySelector('#panel h3').textContent === 'step 700'", timeout=20)
        assert "layer 5 top tokens" in browser.js("document.getElementById('panel').textContent")
        print(f"\n{STEPS} steps, {len(page.encode()) / STEPS / 1024:.1f} KB a step, opened in {opened:.2f} s")
    finally:
        browser.close()


def _point_at_cell(browser, step: int, layer: int) -> None:
    """Moves the pointer over the painted heatmap's cell of `step` and `layer`."""
    at = browser.js(f"""JSON.stringify((() => {{
        const svg = document.querySelector('svg.heatmap[data-cw]'), d = svg.dataset;
        const p = svg.createSVGPoint();
        p.x = +d.x0 + (+d.cw) * ({step} + 0.5);
        p.y = +d.y0 + (+d.ch) * (+d.layers - 1 - {layer} + 0.5);
        svg.scrollIntoView();
        svg.parentElement.scrollLeft = p.x - 100;  // the figure scrolls: the cell into view
        const q = p.matrixTransform(svg.getScreenCTM());
        return {{x: q.x, y: q.y}};
    }})())""")
    point = json.loads(at)
    browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": point["x"], "y": point["y"]})
