"""Integration: the same exactness checks on the bundled SmolLM2-135M-Instruct (offline)."""

from __future__ import annotations

import pytest  # noqa: I001
import torch

import lmtrace
from tests.oracle import hf_greedy, teacher_forced_cached

pytestmark = pytest.mark.integration

PROMPTS = ["很久很久以前，", "🙂 wörld", "The capital of France is"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_generate(bundled_lm, prompt):
    ids = lmtrace.encode_prompt(bundled_lm, prompt)
    trace = lmtrace.generate(bundled_lm, prompt, max_new_tokens=24, temperature=0, top_logprobs=5)
    hf_ids, hf_logits = hf_greedy(bundled_lm, ids, 24)
    assert trace.token_ids == hf_ids
    hf_lp = torch.log_softmax(hf_logits, -1)
    worst = max(abs(s.logprob - hf_lp[i, s.token_id].item()) for i, s in enumerate(trace.steps))
    assert worst < 1e-5, worst
    for i, s in enumerate(trace.steps):
        assert [a.token_id for a in s.top] == torch.topk(hf_lp[i], 5).indices.tolist()
    assert "".join(s.text for s in trace.steps) == bundled_lm.tokenizer.decode(trace.token_ids)


def test_chat_template_and_eos(bundled_lm):
    trace = lmtrace.generate(bundled_lm, "Say hi.", chat=True, max_new_tokens=48, temperature=0)
    ids = trace.prompt["token_ids"]
    assert bundled_lm.tokenizer.decode(ids).startswith("<|im_start|>system")
    hf_ids, _ = hf_greedy(bundled_lm, ids, 48)
    assert trace.token_ids == hf_ids
    assert trace.finish_reason == "stop" and trace.stop_reason == bundled_lm.eos_token_ids[0]
    assert trace.text == bundled_lm.tokenizer.decode(trace.token_ids[:-1])


def test_sampled_logprobs_match_processors(bundled_lm):
    kwargs = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
    trace = lmtrace.generate(bundled_lm, "Once upon a time", max_new_tokens=16, seed=5, **kwargs)
    params = lmtrace.SamplingParams(**kwargs)
    raw, used = teacher_forced_cached(bundled_lm, trace.prompt["token_ids"], trace.token_ids, params)
    assert max(abs(s.logprob - r) for s, r in zip(trace.steps, raw)) < 1e-5
    assert max(abs(s.sampled_logprob - u) for s, u in zip(trace.steps, used)) < 1e-5


def test_batch_matches_alone(bundled_lm):
    traces = lmtrace.generate(bundled_lm, PROMPTS, max_new_tokens=12, temperature=0)
    for prompt, batched in zip(PROMPTS, traces):
        alone = lmtrace.generate(bundled_lm, prompt, max_new_tokens=12, temperature=0)
        assert batched.token_ids == alone.token_ids


def test_summary_of_the_bundled_model(bundled_lm):
    s = bundled_lm.summary
    assert (s.layers, s.attention_heads, s.kv_heads, s.head_dim, s.vocab_size) == (30, 9, 3, 64, 49152)
    assert s.attention == "GQA (group size 3)" and s.context_length == 8192
    assert bundled_lm.source.startswith("bundled:")
