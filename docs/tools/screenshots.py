"""Makes the pictures in docs/images/ from real runs (`make docs-images`): traces with the bundled
model, writes the reports lmtrace writes, opens them in headless Chromium and takes screenshots.
Nothing is drawn by hand; rerun it after changing a report.

    python docs/tools/screenshots.py [--out docs/images] [--keep DIR]

Needs Chromium (Debian's `chromium`; `make browser` installs it) and the bundled model."""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.server.cdp import Browser, find_browser  # noqa: E402  (a small DevTools client, no packages)

WIDTH = 1100
LIMIT = 300_000  # bytes per picture


def shoot(browser: Browser, path: Path, html: Path, *, height: int, hover: str | None = None,
          selector: str | None = None, until: str | None = None, max_height: int = 1000) -> None:
    """Opens `html`, optionally hovers an element, and captures the viewport, or the page from the
    top of `selector` to the bottom of `until` (default: the same element)."""
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False})
    browser.send("Page.navigate", {"url": html.as_uri()})
    browser.wait_for("document.readyState === 'complete'")
    clip = None
    if selector:
        def span(css: str) -> list[float]:  # the element's top and bottom in page coordinates
            return json.loads(browser.js(
                f"JSON.stringify((r => [r.top + scrollY, r.bottom + scrollY])"
                f"(document.querySelector({json.dumps(css)}).getBoundingClientRect()))"))

        top, bottom = span(selector), span(until or selector)
        y = max(top[0] - 8, 0)
        clip = {"x": 0, "y": y, "width": WIDTH, "height": min(bottom[1] + 8 - y, max_height), "scale": 1}
    if hover:
        browser.wait_for(f"!!document.querySelector({json.dumps(hover)})")
        rect = json.loads(browser.js(
            f"JSON.stringify(document.querySelector({json.dumps(hover)}).getBoundingClientRect())"))
        x, y = rect["x"] + rect["width"] / 2, rect["y"] + rect["height"] / 2
        browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        browser.wait_for("document.querySelectorAll('#panel h4').length > 0", timeout=10)
    params = {"format": "png", "captureBeyondViewport": clip is not None}
    if clip:
        params["clip"] = clip
    png = base64.b64decode(browser.send("Page.captureScreenshot", params)["data"])
    save_small(png, path)


def save_small(png: bytes, path: Path) -> None:
    """A palette PNG (256 colours): a screenshot of text and flat colours loses nothing visible."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)
    data = out.getvalue()
    if len(data) > LIMIT:
        raise SystemExit(f"{path.name}: {len(data):,} bytes, over the {LIMIT:,} allowed; shoot a smaller area")
    path.write_bytes(data)
    print(f"{path}: {image.width}×{image.height}, {len(data) // 1024} KiB")


def reports(lm, work: Path) -> dict[str, Path]:
    """The runs the pictures show, written as the reports lmtrace writes."""
    import torch

    import lmtrace
    from lmtrace.render.html.trace import write_html

    made = {}
    trace = lmtrace.generate(lm, "Explain what a KV cache is in one sentence.", chat=True, max_new_tokens=40,
                             temperature=0.8, seed=4, top_logprobs=5, waterfall="all")
    write_html(made.setdefault("report", work / "report.html"), trace)

    inside = lmtrace.generate(lm, "The capital of France is", max_new_tokens=12, temperature=0,
                              lens=True, attention=True)
    write_html(made.setdefault("inside", work / "inside.html"), inside)

    ids = lm.tokenizer("Hello, my name is", return_tensors="pt").input_ids
    with lmtrace.watch(lm.model, record=True) as w:  # the two mistakes of the tutorial
        cache, seq = None, ids
        for _ in range(6):
            out = lm.model(seq, cache=cache, use_cache=True)
            cache = out.cache
            seq = torch.cat([seq, out.logits[:, -1].topk(2).indices[:, -1:]], dim=1)
    write_html(made.setdefault("loop", work / "loop.html"), w.trace(lm.tokenizer, tokens=seq))

    from lmtrace.render.html.kvlab import write_lab_html

    lab = lmtrace.kvlab(lm, "Summarize the plot of Romeo and Juliet in three sentences.",
                        policies=["streaming:sinks=4,window=16", "h2o:budget=0.25", "fp8"],
                        max_new_tokens=32, temperature=0)
    write_lab_html(made.setdefault("kvlab", work / "kvlab.html"), lab)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--keep", type=Path, help="keep the reports in this folder")
    args = parser.parse_args()
    executable = find_browser()
    if executable is None:
        raise SystemExit("no Chromium found: `make browser` installs Debian's (as root)")
    import lmtrace

    lm = lmtrace.load()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        made = reports(lm, work)
        args.out.mkdir(parents=True, exist_ok=True)
        browser = Browser(executable, str(Path(tmp) / "profile"))  # a fresh profile every run
        try:
            browser.open("about:blank")
            shoot(browser, args.out / "loop-problems.png", made["loop"], height=1000, selector="#problems",
                  until="#text", hover='.tok[data-i="1"]')
            shoot(browser, args.out / "report.png", made["report"], height=760, hover='.tok[data-i="9"]')
            shoot(browser, args.out / "report-inside.png", made["inside"], height=900, selector="#lens",
                  until="#attention")
            shoot(browser, args.out / "kv-lab.png", made["kvlab"], height=820)
        finally:
            browser.close()


if __name__ == "__main__":
    main()
