from __future__ import annotations

import json
import math

import pytest

import lmtrace
from lmtrace import Trace


@pytest.fixture(scope="module")
def sampled_trace(tiny_lm):
    return lmtrace.generate(
        tiny_lm, "🙂 wörld", max_new_tokens=12, temperature=0.9, top_p=0.8, seed=2, top_logprobs=4, stop_on_eos=False
    )


def test_json_round_trip_is_lossless(sampled_trace):
    text = sampled_trace.to_json()
    back = Trace.from_json(text)
    assert back == sampled_trace
    assert back.to_json() == text


def test_json_has_the_documented_fields(sampled_trace):
    d = json.loads(sampled_trace.to_json())
    assert d["schema_version"] == 1
    for key in ("model", "params", "prompt", "text", "finish_reason", "timing", "steps", "versions"):
        assert key in d
    assert {"source", "config", "dtype", "device"} <= set(d["model"])
    assert d["prompt"]["text"] == "🙂 wörld" and d["prompt"]["token_ids"]
    step = d["steps"][0]
    for key in (
        "token_id",
        "text",
        "bytes",
        "logprob",
        "sampled_logprob",
        "rank",
        "entropy",
        "sampled_entropy",
        "top",
        "kv",
        "time_ms",
    ):
        assert key in step
    assert set(step["top"][0]) >= {"token_id", "text", "logprob", "sampled_logprob"}
    assert set(step["kv"]) >= {"seq_len", "bytes"}
    assert d["timing"]["decode_tokens_per_s"] > 0
    assert "NaN" not in sampled_trace.to_json() and "Infinity" not in sampled_trace.to_json()


def test_wrong_schema_version_is_refused(sampled_trace):
    d = sampled_trace.to_dict()
    d["schema_version"] = 2
    with pytest.raises(ValueError, match="schema_version must be 1, got 2"):
        Trace.from_dict(d)


def test_openai_export_shape(sampled_trace):
    out = sampled_trace.to_openai()
    assert len(out["content"]) == len(sampled_trace.steps)
    for item, step in zip(out["content"], sampled_trace.steps):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == step.bytes and item["logprob"] == step.logprob
        assert len(item["top_logprobs"]) == 4
        assert all(set(t) == {"token", "logprob", "bytes"} for t in item["top_logprobs"])
    processed = sampled_trace.to_openai(sampled=True)
    floor = [t["logprob"] for c in processed["content"] for t in c["top_logprobs"]]
    assert all(math.isfinite(x) for x in floor)  # -inf becomes OpenAI's -9999.0
    assert -9999.0 in floor
