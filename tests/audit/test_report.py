"""The audit's report without a server: the JSON shape, the HTML page (escaped, one row per
probe, the evidence of a failure open), the URL and argument checks."""

from __future__ import annotations

import json
import math

import pytest

from lmtrace.comparison.audit import AuditReport, ProbeResult, check_probes
from lmtrace.comparison.audit.client import base_url
from lmtrace.errors import InvalidParameter
from lmtrace.render.html.audit import render_audit_html


def report() -> AuditReport:
    evil = "<script>alert(1)</script>"
    probes = [
        ProbeResult("logprobs", "pass", "fine", {"greedy": {"abs_diff": {"max": 1e-6}}, "kl": math.inf}),
        ProbeResult(
            "echo",
            "fail",
            f"token {evil!r} differs",
            {"problems": ["a", "b"]},
            {"request": {"body": {"prompt": evil}}, "curl": f"curl -s -d '{evil}'"},
        ),  # fmt: skip
        ProbeResult("tokenize", "skip", "the server has no /tokenize (HTTP 404)"),
    ]
    return AuditReport("http://127.0.0.1:8000", "smol", "bundled", 0.01, probes, {"tokenization": "matches (echo)"})


def test_json_shape():
    d = json.loads(report().to_json())
    assert set(d) >= {"server", "model", "probes"} and d["summary"] == {"pass": 1, "fail": 1, "skip": 1}
    assert [set(p) >= {"name", "status", "detail", "figures"} for p in d["probes"]] == [True] * 3
    assert d["probes"][0]["figures"]["kl"] is None  # JSON has no inf
    assert "evidence" in d["probes"][1] and "evidence" not in d["probes"][0]
    assert report().exit_code == 1


def test_html_escapes_and_opens_the_evidence_of_a_failure():
    page = render_audit_html(report())
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert page.count('<tr id="') == 3 and "<details open>" in page
    assert '<span class="status fail">fail</span>' in page and "1 fail" in page


def test_urls_and_probe_names():
    assert base_url("http://h:8000/v1/") == base_url("http://h:8000") == "http://h:8000"
    with pytest.raises(InvalidParameter, match="url must start with http"):
        base_url("h:8000")
    assert check_probes(["echo", "echo", "stop"]) == ["echo", "stop"]
    with pytest.raises(InvalidParameter, match="probe: unknown 'x'"):
        check_probes(["x"])
