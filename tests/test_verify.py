"""verify: agrees on a right cache, fails on a deliberately broken one; the cache command."""

from __future__ import annotations

import json

import pytest
from transformers.cache_utils import DynamicSlidingWindowLayer

import lmtrace
from lmtrace.cli import main
from lmtrace.kv import ledger as kv
from lmtrace.scoring.teacher.verify import verify


def broken_cache(model):
    """A cache that silently forgets all but the last 3 positions of a full-attention model."""
    cache = kv.DynamicCache(config=model.config)
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4) for _ in cache.layers]
    return cache


def test_verify_agrees_on_the_tiny_model(tiny_lm):
    report = verify(tiny_lm, lmtrace.encode_prompt(tiny_lm, "Hello world, the quick"), 16)
    assert report.ok and report.first_divergence is None
    assert len(report.steps) == 16 and report.max_logprob_diff < 1e-5
    assert all(s.top1_agrees and s.generate_token_id == s.token_id for s in report.steps)


def test_verify_fails_on_a_broken_cache(tiny_lm, monkeypatch):
    monkeypatch.setattr(kv, "new_cache", broken_cache)
    report = verify(tiny_lm, lmtrace.encode_prompt(tiny_lm, "Hello world, the quick"), 16)
    assert not report.ok
    assert report.max_logprob_diff > 1e-2
    assert report.first_divergence is not None and report.first_divergence["margin"] >= 0


def test_verify_cli_exit_codes(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "v.json"
    assert main(["verify", "Hello world", "--model", str(tiny_dir), "--max-new-tokens", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ok"] is True
    assert "OK: 8 steps agree" in capsys.readouterr().out
    monkeypatch.setattr(kv, "new_cache", broken_cache)
    assert main(["verify", "Hello world, the quick", "--model", str(tiny_dir), "--max-new-tokens", "8"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["verify", "x", "--model", str(tiny_dir), "--tolerance", "-1"]) == 2


def test_cache_command_writes_the_ledger(tiny_dir, tmp_path, capsys):
    out = tmp_path / "ledger.json"
    assert main(["cache", "Hello world", "--model", str(tiny_dir), "--max-new-tokens", "5", "--temperature", "0",
                 "--json", str(out), "--html", str(tmp_path / "r.html"), "--no-color"]) == 0  # fmt: skip
    assert "KV cache" in (tmp_path / "r.html").read_text()
    d = json.loads(out.read_text())
    assert len(d["steps"]) == 5 and d["anatomy"]["kv_heads"] == 2 and d["anatomy"]["mismatches"] == []
    assert d["steps"][1]["bytes"] - d["steps"][0]["bytes"] == d["anatomy"]["bytes_per_token"]
    shown = capsys.readouterr().out
    for text in ("num_key_value_heads", "bytes = 2 (keys and values) × layers", "= 2 × 2 × 2 × 16 × 4 × 1 ×",
                 "growth", "KV cache bytes per step"):
        assert text in shown


def test_cache_demo_misuse(tiny_dir, capsys):
    assert main(["cache", "Hello world, the quick", "--model", str(tiny_dir), "--demo-misuse", "--rounds", "4",
                 "--json", "-"]) == 0  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    n = d["prompt_len"]
    assert [r["correct_cache_len"] for r in d["rounds"]] == [n, n + 1, n + 2, n + 3]
    assert [r["refeed_cache_len"] for r in d["rounds"]] == [n, 2 * n + 1, 3 * n + 3, 4 * n + 6]
    assert d["rounds"][0]["max_logit_diff"] == 0 and d["rounds"][1]["max_logit_diff"] > 0
    assert d["correct_problems"] == [] and len(d["refeed_problems"]) == 3


@pytest.mark.integration
def test_verify_agrees_on_the_bundled_model(bundled_lm):
    report = verify(bundled_lm, lmtrace.encode_prompt(bundled_lm, "The capital of France is"), 16)
    assert report.ok, report.to_dict()["first_divergence"]


def test_verify_in_bfloat16_reports_the_difference_against_float32(tiny_dir):
    lm = lmtrace.load(tiny_dir, dtype="bfloat16")
    report = verify(lm, lmtrace.encode_prompt(lm, "Hello world"), 6)
    d = report.to_dict()
    assert d["dtype"] == "bfloat16" and d["tolerance"] == 0.1
    assert 0 < d["float32_max_logprob_diff"] < 1.0


def test_verify_rescore_round_trip(tiny_dir, capsys):
    assert main(["verify", "Hello world", "--model", str(tiny_dir), "--max-new-tokens", "6", "--rescore",
                 "--json", "-"]) == 0  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert d["rescore"]["steps"] == 6 and d["rescore"]["max_abs_diff"] < 1e-5
