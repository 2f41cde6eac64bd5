"""compare on real recorded responses (tests/fixtures/compare/, with the scripts that recorded
them), against the bundled model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lmtrace

pytestmark = pytest.mark.integration
FIXTURES = Path(__file__).parent / "fixtures" / "compare"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_lmtrace_server_completions_are_raw_and_exact(bundled_lm):
    result = lmtrace.compare(bundled_lm, load("lmtrace_server_completions.json"))
    s = result.summary
    assert result.kind == "openai-completions" and result.unmapped == []
    assert s["compared"] == 24 and s["verdict"] == "raw"
    assert s["top1_agreement"] == 1.0 and s["max_abs_diff"] < 1e-4


def test_lmtrace_server_echo_scores_the_prompt_too(bundled_lm):
    record = load("lmtrace_server_completions_echo.json")
    prompt_tokens = record["response"]["usage"]["prompt_tokens"]
    result = lmtrace.compare(bundled_lm, record)
    assert result.summary["compared"] == prompt_tokens - 1 + 16
    assert result.summary["verdict"] == "raw" and result.summary["max_abs_diff"] < 1e-4


def test_lmtrace_server_chat(bundled_lm):
    result = lmtrace.compare(bundled_lm, load("lmtrace_server_chat.json"))
    s = result.summary
    assert result.kind == "openai-chat" and s["verdict"] == "raw" and s["max_abs_diff"] < 1e-4
    assert s["mean_kl_top"] < 1e-6


def test_tempered_chat_is_recognised_as_processed(bundled_lm):
    record = load("lmtrace_server_chat_tempered.json")
    result = lmtrace.compare(bundled_lm, record)
    s = result.summary
    assert s["verdict"] == "processed" and abs(s["best_temperature"]["temperature"] - 0.5) < 0.03
    told = lmtrace.compare(bundled_lm, record, temperature=0.5)
    assert told.summary["verdict"] == "processed" and told.summary["mean_abs_diff_processed"] < 1e-4
