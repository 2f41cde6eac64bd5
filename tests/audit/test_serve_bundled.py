"""`lmtrace audit` against a real `lmtrace serve` process on the bundled SmolLM2-135M-Instruct
(a free loopback port): every probe passes, and the reports are written."""

from __future__ import annotations

import json

import pytest

from lmtrace.cli import main
from lmtrace.comparison.audit import PROBE_NAMES

pytestmark = pytest.mark.integration


@pytest.mark.usefixtures("shared_bundled")  # the audit's own model: the session's bundled_lm
def test_lmtrace_serve_passes_every_probe(bundled_server, tmp_path, capsys):
    serve = bundled_server  # tests/conftest.py: the suite's one `lmtrace serve` of the bundled model
    report, page = tmp_path / "audit.json", tmp_path / "audit.html"
    # 6 tokens per generation, not the default 12: every probe compares each token alike, and half
    # the tokens halve the server's decoding, most of this test's time
    code = main(["audit", serve, "--json", str(report), "--html", str(page), "--no-color", "--timeout", "600",
                 "--max-tokens", "6"])  # fmt: skip
    d = json.loads(report.read_text(encoding="utf-8"))
    outcome = "\n".join(f"{p['status']} {p['name']}: {p['detail']}" for p in d["probes"])
    assert code == 0, outcome
    assert [p["name"] for p in d["probes"]] == list(PROBE_NAMES)
    assert all(p["status"] == "pass" for p in d["probes"]), outcome
    assert d["served_model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert d["preflight"]["tokenization"] == "matches (/tokenize)"
    figures = {p["name"]: p["figures"] for p in d["probes"]}
    assert figures["logprobs"]["greedy"]["abs_diff"]["max"] < 1e-4  # float32 on both sides
    assert figures["logprobs"]["sampled"]["distribution"] == "raw"
    assert figures["repeat"]["identical"] and figures["prompts"]["n"] == 2
    assert page.read_text(encoding="utf-8").count('<span class="status pass">pass</span>') == len(PROBE_NAMES)
    assert "12 pass, 0 fail, 0 skip" in capsys.readouterr().out
