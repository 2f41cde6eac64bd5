"""The HTML report and the notebook view, checked as text: parsed with html.parser (no browser
needed): self-contained, model text escaped everywhere, the data present."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
from html.parser import HTMLParser

import pytest

import lmtrace
from lmtrace import InvalidParameter, Trace
from lmtrace.render.html.svg import human_bytes, nice_ticks
from lmtrace.render.html.templating import script_json
from lmtrace.render.html.trace import notebook_html, render_html, write_html
from lmtrace.render.tokens import escape, show_bytes
from tests import handmade
from tests.handmade import PAYLOAD


class Page(HTMLParser):
    """Every start tag with its attributes; the text of each <script>; the text of each token box."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.tokens: list[str] = []
        self._script: dict | None = None
        self._depth = 0  # >0 while inside a token box
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script":
            self._script = a
            self.scripts.append((a, ""))
        if tag == "span" and self._depth:
            self._depth += 1
        elif tag == "span" and "tok" in (a.get("class") or "").split() and "data-i" in a:
            self._depth = 1
            self.tokens.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None
        if tag == "span" and self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._script is not None:
            self.scripts[-1] = (self.scripts[-1][0], self.scripts[-1][1] + data)
        elif self._depth:
            self.tokens[-1] += data

    def data(self) -> dict:
        """The embedded data, each view's steps read from their own lines (parsed by the page one by one)."""
        (text,) = [body for a, body in self.scripts if a.get("type") == "application/json"]
        data = json.loads(text)
        lines = [body for a, body in self.scripts if a.get("type") == "application/x-ndjson"]
        for view, body in zip(data["views"], lines):
            view["steps"] = [json.loads(line) for line in body.split("\n")]
        return data


def assert_self_contained(html: str, page: Page) -> None:
    for tag, attrs in page.tags:
        assert tag not in ("img", "link", "iframe", "object", "embed", "base", "form"), tag
        for name in ("src", "href", "srcset", "action", "poster", "data"):
            assert name not in attrs, (tag, name)
        assert not any(k.startswith("on") for k in attrs), (tag, attrs)
    assert not re.search(r"https?://|url\(|@import|//cdn", html)


def test_trace_report_is_self_contained_and_escapes_model_text():
    html = render_html(handmade.trace_dict(layers=True))
    page = Page(html)
    assert_self_contained(html, page)
    assert PAYLOAD not in html  # nowhere raw: not in the markup, not in the embedded data
    assert "\u2028" not in html.split('id="lmtrace-data">')[1].split("</script>")[0]
    assert "\u2028" not in html.split('id="lmtrace-steps-0">')[1].split("</script>")[0]
    assert [t for t, _ in page.tags].count("script") == 3  # the data, the steps' lines, the code
    # the code that runs is exactly the inline script the policy names by its hash
    csp = next(a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    (code,) = [body for a, body in page.scripts if "type" not in a]
    digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp and "default-src 'none'" in csp
    # the payload shows as text: in a token box, in the header, and in the data as a string
    assert "</script><img␣src=x␣onerror=alert(1)>" in page.tokens
    data = page.data()
    steps = data["views"][0]["steps"]
    assert steps[3]["shown"] == "</script><img␣src=x␣onerror=alert(1)>"
    assert steps[3]["top"][1]["shown"].startswith("</script><img␣src=x")
    assert steps[8]["shown"] == "\\u2028\\u2029"  # invisible line separators made visible


def test_trace_report_shows_the_data():
    d = handmade.trace_dict(layers=True)
    page = Page(render_html(d))
    data = page.data()
    assert data["kind"] == "trace" and data["sampled"] is True
    steps = data["views"][0]["steps"]
    assert len(steps) == len(page.tokens) == len(d["steps"])
    for view, step in zip(steps, d["steps"]):
        assert view["p"] == pytest.approx(math.exp(step["logprob"]), rel=1e-5)
        assert view["rank"] == step["rank"] and view["H"] == pytest.approx(step["entropy"])
        assert [a["id"] for a in view["top"]] == [a["token_id"] for a in step["top"]]
        kv = [dict(zip(view["kv"]["cols"], row)) for row in view["kv"]["rows"]]  # the layers as a table
        assert kv == step["kv"]["layers"] and view["waterfall"] == step["waterfall"]
    # byte pieces, whitespace and newlines made visible
    assert page.tokens[4:7] == ["<0xE7>", "<0xBE>", "美"]
    assert steps[4]["kind"] == "byte" and steps[6]["kind"] == "completes" and steps[6]["own"] == "<0x8E>"
    assert page.tokens[1] == "␣world" and page.tokens[2] == "↵"
    boxes = [a for t, a in page.tags if t == "span" and "data-r" in a and "data-i" in a]
    assert [int(b["data-r"]) for b in boxes] == [s["r"] for s in steps]
    assert {"0", "4"} <= {b["data-r"] for b in boxes}
    ids = {a.get("id") for _, a in page.tags}
    assert {"text", "charts", "kv", "steps", "panel"} <= ids
    assert any(a.get("name") == "dist" and a.get("value") == "sampled" for t, a in page.tags if t == "input")
    html = render_html(d)
    assert "By layer, after step 9" in html and "num_key_value_heads" in html and "sources.kv_heads" not in html
    assert "The measured KV cache differs from the formula at step 3" in html
    assert html.count('<svg class="chart"') == 4  # probability, entropy, KV bytes, bytes per layer


def test_greedy_trace_has_no_sampled_switch():
    d = handmade.trace_dict(temperature=0)
    for s in d["steps"]:
        s["sampled_logprob"] = s["logprob"]
    page = Page(render_html(d))
    assert page.data()["sampled"] is False
    assert not any(t == "input" for t, _ in page.tags)


def test_score_result_report():
    html = render_html(handmade.score_dict())
    page = Page(html)
    assert_self_contained(html, page)
    data = page.data()
    assert data["kind"] == "score" and len(data["views"][0]["steps"]) == 4
    assert page.tokens[0] == "The" and data["views"][0]["steps"][0]["r"] == -1  # not scored
    assert "3.21" in html and "bits_per_byte" in html and PAYLOAD not in html


def test_branches_report_marks_the_divergence():
    html = render_html(handmade.branches_dict())
    page = Page(html)
    assert_self_contained(html, page)
    assert [v["label"] for v in page.data()["views"]] == ["original", "branch 1"]
    texts = [a for t, a in page.tags if t == "div" and a.get("class") == "text"]
    assert [a["data-v"] for a in texts] == ["0", "1"]
    boxes = [a["class"].split() for t, a in page.tags if t == "span" and "data-i" in a]
    assert ["div" in c for c in boxes] == [False, False, True, True] * 2
    assert ["fork" in c for c in boxes] == [False, False, True, False] * 2
    assert "leaves the original at step 2" in html


def test_traces_from_the_tiny_model(tiny_lm, tmp_path):
    trace = lmtrace.generate(
        tiny_lm, "很久很久以前，", max_new_tokens=10, temperature=0.9, top_k=20, seed=1, stop_on_eos=False
    )
    out = tmp_path / "report.html"
    write_html(out, trace)
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as a plain open() would make it
    html = out.read_text(encoding="utf-8")
    page = Page(html)
    assert_self_contained(html, page)
    steps = page.data()["views"][0]["steps"]
    assert [s["id"] for s in steps] == trace.token_ids
    assert [s["kv"]["seq_len"] for s in steps] == [s.kv["seq_len"] for s in trace.steps]
    assert page.tokens == [escape(s.text) if s.text else show_bytes(s.bytes) for s in trace.steps]
    assert render_html(trace) == render_html(trace.to_dict()) == render_html(Trace.from_json(trace.to_json()))
    branches = render_html([trace, trace])
    assert Page(branches).data()["kind"] == "branches"


def test_notebook_view_is_a_fragment_without_script(tiny_lm):
    d = handmade.trace_dict()
    html = Trace.from_dict(d)._repr_html_()
    page = Page(html)
    assert not any(t in ("script", "html", "head", "body") for t, _ in page.tags)
    assert_self_contained(html, page)
    assert PAYLOAD not in html
    assert "</script><img␣src=x␣onerror=alert(1)>" in html.replace("&lt;", "<").replace("&gt;", ">")
    assert html.count('class="tip"') == len(d["steps"])
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=3, temperature=0)
    assert trace._repr_html_().count('class="tip"') == len(trace.steps)
    with pytest.raises(InvalidParameter, match="notebook view is for a trace"):
        notebook_html(handmade.score_dict())


def test_bad_records_are_refused():
    with pytest.raises(InvalidParameter, match="not a trace"):
        render_html({"hello": 1})
    d = handmade.trace_dict()
    d["schema_version"] = 2
    with pytest.raises(InvalidParameter, match="schema_version must be 1, got 2"):
        render_html(d)
    with pytest.raises(InvalidParameter, match="branch 1: "):
        render_html({"branches": [handmade.trace_dict(), {"steps": []}]})


def test_script_json_escapes_for_a_script_element():
    value = {"t": "</script><!--<b>&\u2028\u2029"}
    text = str(script_json(value))
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        assert raw not in text
    assert json.loads(text) == value
    assert str(script_json({"x": float("-inf"), "y": [float("nan")]})) == '{"x":null,"y":[null]}'


def test_chart_helpers():
    assert nice_ticks(1.0) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert nice_ticks(2.7)[-1] >= 2.7 and len(nice_ticks(2.7)) <= 7
    assert nice_ticks(3 * 1024**2, binary=True)[-1] % 1024**2 == 0
    assert human_bytes(512) == "512 B" and human_bytes(2048) == "2 KiB" and human_bytes(3 * 1024**2) == "3 MiB"


def test_render_reads_records_only():
    """No torch or transformers under render/: reports work from saved JSON alone."""
    import ast
    from pathlib import Path

    import lmtrace.render

    allowed = {"lmtrace.errors", "lmtrace.files", "lmtrace.records", "lmtrace.trace_file"}  # a record and its files
    for path in Path(lmtrace.render.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("torch", "transformers"), (path.name, name)
                if name.startswith("lmtrace") and not name.startswith("lmtrace.render"):
                    assert name in allowed, (path.name, name)
