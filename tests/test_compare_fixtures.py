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


@pytest.mark.parametrize("name", ["llama_cpp_greedy.json", "llama_cpp_chat.json"])
def test_llama_cpp_greedy_agrees_within_quantization(bundled_lm, name):
    """llama.cpp computes with the Q4_1 weights (and quantized activations); transformers
    dequantizes the same weights to float32: close, not equal."""
    result = lmtrace.compare(bundled_lm, load(name))
    s = result.summary
    assert result.unmapped == [] and s["compared"] == 32
    assert s["top1_agreement"] >= 0.9 and s["mean_abs_diff"] < 0.1
    assert s["verdict"] == "raw" and s["mean_kl_top"] < 0.01


def test_llama_cpp_sampled_reports_raw_logprobs(bundled_lm):
    """llama-cpp-python's logprobs are the raw distribution even when it samples at 0.8."""
    record = load("llama_cpp_sampled.json")
    result = lmtrace.compare(bundled_lm, record, temperature=0.8, top_k=40, top_p=0.95)
    s = result.summary
    assert s["compared"] == 32 and s["mean_abs_diff"] < 0.1
    assert s["verdict"] == "raw" and s["mean_abs_diff"] < s["mean_abs_diff_processed"]


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llama_cpp"), reason="llama-cpp-python not installed")
def test_llama_cpp_live(bundled_lm):
    from llama_cpp import Llama

    from lmtrace.model.load import bundled_gguf

    llm = Llama(model_path=str(bundled_gguf()), n_ctx=512, logits_all=True, verbose=False)
    request = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.0, "logprobs": 5}
    response = json.loads(json.dumps(llm.create_completion(**request), default=float))
    s = lmtrace.compare(bundled_lm, {"request": request, "response": response}).summary
    assert s["top1_agreement"] >= 0.9 and s["mean_abs_diff"] < 0.1


def test_llama_server_completion_probabilities(bundled_lm):
    """llama.cpp's own server (/completion with n_probs): raw probabilities by default."""
    result = lmtrace.compare(bundled_lm, load("llama_server_greedy.json"))
    s = result.summary
    assert result.kind == "llama.cpp" and result.unmapped == [] and s["compared"] == 24
    assert s["top1_agreement"] >= 0.9 and s["mean_abs_diff"] < 0.1 and s["verdict"] == "raw"


def test_llama_server_post_sampling_probs_are_processed(bundled_lm):
    """With post_sampling_probs the server reports the distribution after its samplers (T 0.5)."""
    record = load("llama_server_tempered.json")
    s = lmtrace.compare(bundled_lm, record).summary
    assert s["verdict"] == "processed" and abs(s["best_temperature"]["temperature"] - 0.5) < 0.03
    told = lmtrace.compare(bundled_lm, record, temperature=0.5).summary
    assert told["verdict"] == "processed" and told["mean_abs_diff_processed"] < 0.1 < told["mean_abs_diff"]
