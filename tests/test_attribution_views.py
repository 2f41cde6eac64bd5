"""Attribution's views: the report's heatmap section and the panel's data, the terminal tables,
and the intervene page; model text escaped."""

from __future__ import annotations

import pytest
from rich.console import Console

import lmtrace
from lmtrace.render.html.intervene import render_intervene_html
from lmtrace.render.html.trace import page_data, render_html
from lmtrace.render.terminal.attribution import attribution_table, parts_table, ranked
from lmtrace.render.terminal.intervene import print_arms


@pytest.fixture(scope="module")
def traced(tiny_lm):
    return lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=5, temperature=0, attribution=True)


def _data(html: str) -> dict:
    return page_data(html)


def test_report_has_the_heatmap_and_the_panel_data(traced, tiny_lm):
    html = render_html(traced)
    assert "Attribution: why this token and not that one" in html
    layers = tiny_lm.model.config.num_hidden_layers
    section = html[html.index('id="attribution"') :]
    assert section.count('class="cell"') >= 2 * layers * len(traced.steps)
    view = _data(html)["views"][0]["steps"][1]["attr"]
    values = [abs(v) for _, v in view["parts"]]
    assert values == sorted(values, reverse=True)
    assert {name for name, _ in view["parts"]} == {p["component"] for p in traced.steps[1].attribution["parts"]}
    assert sorted(view["heads"]) == [str(i) for i in range(layers)]
    assert view["diff"] == pytest.approx(traced.steps[1].attribution["logit_diff"], rel=1e-3)


def test_model_text_is_escaped_in_the_heatmap(traced):
    d = traced.to_dict()
    d["steps"][0]["text"] = "<script>alert(1)</script>"
    html = render_html(d)
    assert "<script>alert(1)</script>" not in html.split('id="attribution"', 1)[1].split("</section>", 1)[0]


def test_terminal_tables(traced):
    console = Console(width=80, record=True, no_color=True)
    console.print(attribution_table(traced))
    console.print(parts_table(traced.steps[0].attribution))
    out = console.export_text()
    top = ranked(traced.steps[0].attribution, 1)[0]
    assert "largest parts" in out and top["component"] in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_intervene_page_and_terminal(tiny_lm):
    result = lmtrace.intervene(tiny_lm, "Hello world", ablate=["0.h1", "1.mlp"], max_new_tokens=4, temperature=0)
    html = render_intervene_html(result)
    assert "0.h1" in html and "1.mlp" in html and "Summary" in html
    assert len(_data(html)["views"]) == 3
    console = Console(width=100, record=True, no_color=True)
    print_arms(result.to_dict(), console, steps=True)
    out = console.export_text()
    assert "mean KL" in out and "1.mlp" in out
