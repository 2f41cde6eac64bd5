"""The KV ledger: measured per layer at every step, equal to the formula, on models with full,
grouped, single-KV-head and sliding-window attention built in-process."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import lmtrace
from lmtrace.kv import size as kvsize
from lmtrace.model.lm import LM

SMALL = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             max_position_embeddings=128, vocab_size=300, eos_token_id=0, pad_token_id=1)  # fmt: skip


def build(cls, config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return cls(config).eval()


MODELS = {
    "MHA": lambda: build(LlamaForCausalLM, LlamaConfig(num_key_value_heads=4, **SMALL)),
    "GQA": lambda: build(LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, **SMALL)),
    "MQA": lambda: build(LlamaForCausalLM, LlamaConfig(num_key_value_heads=1, **SMALL)),
    "explicit head_dim": lambda: build(LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, head_dim=24, **SMALL)),
    "sliding (all layers)": lambda: build(
        MistralForCausalLM, MistralConfig(num_key_value_heads=2, sliding_window=6, **SMALL)
    ),  # fmt: skip
    "sliding (layers 2, 3)": lambda: build(
        Qwen2ForCausalLM,
        Qwen2Config(num_key_value_heads=2, sliding_window=6, use_sliding_window=True, max_window_layers=2, **SMALL),
    ),  # fmt: skip
}


def hand_formula(config, positions: int, batch: int = 1, element: int = 4) -> int:
    """The documented formula, written out again independently of kvsize.py."""
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if isinstance(config, MistralConfig):
        types = ["sliding_attention"] * config.num_hidden_layers
    total = 0
    for kind in types:
        held = min(positions, config.sliding_window - 1) if kind == "sliding_attention" else positions
        total += 2 * kv_heads * head_dim * held * batch * element
    return total


@pytest.fixture(scope="module")
def tok():
    from tests.tiny import tiny_tokenizer

    return tiny_tokenizer()


@pytest.mark.parametrize("name", list(MODELS))
def test_ledger_equals_the_formula_at_every_step(tok, name):
    model = MODELS[name]()
    lm = LM.from_objects(model, tok, source=name)
    trace = lmtrace.generate(lm, "Hello world, the quick brown", max_new_tokens=10, temperature=0, stop_on_eos=False)
    n = len(trace.prompt["token_ids"])
    assert trace.kv_anatomy["mismatches"] == []
    an = kvsize.anatomy(model.config)
    for i, step in enumerate(trace.steps):
        kv = step.kv
        assert kv["seq_len"] == n + i
        assert kv["bytes"] == kv["expected_bytes"] == hand_formula(model.config, n + i) == an.bytes_at(n + i)
        assert len(kv["layers"]) == model.config.num_hidden_layers
        for layer in kv["layers"]:
            b, h, s, d = layer["keys"]
            assert layer["values"] == layer["keys"]
            assert (b, h, d) == (1, model.config.num_key_value_heads, an.head_dim)
            assert s == (min(n + i, layer["window"] - 1) if layer["kind"] == "sliding_window" else n + i)
            assert layer["bytes"] == layer["bytes_used"] == 2 * b * h * s * d * 4
            assert layer["dtype"] == "float32"


def test_sliding_window_really_caps_the_cache(tok):
    model = MODELS["sliding (layers 2, 3)"]()
    trace = lmtrace.generate(LM.from_objects(model, tok), "Hello world, the quick brown", max_new_tokens=4,
                             temperature=0, stop_on_eos=False)  # fmt: skip
    layers = trace.steps[-1].kv["layers"]
    assert [x["kind"] for x in layers] == ["full_attention", "full_attention", "sliding_window", "sliding_window"]
    assert layers[2]["keys"][2] == 5 < layers[0]["keys"][2]
    assert trace.kv_anatomy["sliding_layers"] == [2, 3] and trace.kv_anatomy["windows"] == [6]


def test_batch_ledger_counts_every_row(tiny_lm):
    traces = lmtrace.generate(tiny_lm, ["Hello", "Once upon a time there"], max_new_tokens=3, temperature=0)
    kv = traces[0].steps[0].kv
    assert kv["layers"][0]["keys"][0] == 2
    assert kv["bytes"] == kv["expected_bytes"] == hand_formula(tiny_lm.model.config, kv["seq_len"], batch=2)
    assert traces[0].kv_anatomy["batch"] == 2


def test_anatomy_explains_where_the_numbers_come_from(tiny_lm):
    an = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=1, temperature=0).kv_anatomy
    assert an["attention"] == "GQA (group size 2)"
    assert an["sources"]["kv_heads"] == "num_key_value_heads = 2"
    assert an["sources"]["head_dim"] == "head_dim = hidden_size / num_attention_heads = 64 / 4 = 16"
    assert an["formula"].startswith("bytes = 2 × 2 layers × 2 kv_heads × 16 head_dim × positions")
    assert an["bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_a_mismatch_is_reported(tiny_lm, monkeypatch):
    from lmtrace.decode import engine

    real = engine.expected_bytes
    monkeypatch.setattr(engine, "expected_bytes", lambda m, b: lambda s: real(m, b)(s) + 1)
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=3, temperature=0)
    assert trace.kv_anatomy["mismatches"] == [0, 1, 2]


@pytest.mark.integration
def test_bundled_ledger(bundled_lm):
    trace = lmtrace.generate(bundled_lm, "很久很久以前，", max_new_tokens=6, temperature=0)
    n = len(trace.prompt["token_ids"])
    for i, s in enumerate(trace.steps):
        assert s.kv["bytes"] == s.kv["expected_bytes"] == 2 * 30 * 3 * 64 * (n + i) * 4
        assert s.kv["layers"][0]["keys"] == [1, 3, n + i, 64]
    assert trace.kv_anatomy["mismatches"] == []
