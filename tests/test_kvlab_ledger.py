"""The KV ledger reads compressed caches right: a quantized layer keeps its data outside
`.keys/.values` (fp8: `_quantized_keys` = (float8 tensor, scale); optimum-quanto: a packed
QTensor) and is measured there; an evicted layer is measured at its kept length. Also: the
lab on a sliding-window model leaves the sliding layers to transformers' own rule."""

from __future__ import annotations

import math
import types

import pytest
import torch
from transformers import DynamicCache, QuantizedCache, Qwen2Config, Qwen2ForCausalLM

from lmtrace.kv import ledger as kv
from lmtrace.kvlab import kvlab
from lmtrace.model.lm import LM


@pytest.fixture
def quanto(monkeypatch):
    """optimum-quanto, its CPU unpacking of int4/int2 on its own torch implementation (the op's
    "default" one: the same shifts and masks). Otherwise its first use compiles quanto's C++
    extension into the installed package (~45 s on a fresh .venv, 2 cores); what is measured here
    is the packed storage the cache holds, not how quanto unpacks it to attend."""
    pytest.importorskip("optimum.quanto")
    from optimum.quanto.library.extensions import cpp

    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)  # quanto's "default" impl

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
        return torch.ops.quanto.unpack.default.redispatch(default, packed, bits)

    monkeypatch.setattr(cpp.ext, "_lib", types.SimpleNamespace(unpack=unpack))


def _fill(model, cache, n: int = 10, decode: int = 3) -> None:
    with torch.no_grad():
        model(input_ids=torch.arange(5, 5 + n)[None], **kv.cache_kwargs(model, cache))
        for i in range(decode):
            model(input_ids=torch.tensor([[40 + i]]), position_ids=torch.tensor([[n + i]]),
                  **kv.cache_kwargs(model, cache))  # fmt: skip


def _dims(model):
    c = model.config
    return c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads


def test_fp8_layers_are_counted_from_their_quantized_storage(tiny_lm):
    model = tiny_lm.model
    cache = QuantizedCache(backend="fp8", config=model.config)
    _fill(model, cache)
    layers, heads, dim = _dims(model)
    state = kv.state(cache)
    assert state.bytes == layers * (2 * heads * 13 * dim * 1 + 2 * 4)  # 13 positions, 1 byte each, 2 scales
    assert all(e["dtype"] == "float8_e4m3fn" and e["quantized_bytes"] == e["bytes"] for e in state.layers)


def test_dynamic_cache_still_counts_its_tensors(tiny_lm):
    model = tiny_lm.model
    cache = DynamicCache(config=model.config)
    _fill(model, cache)
    layers, heads, dim = _dims(model)
    assert kv.state(cache).bytes == layers * 2 * heads * 13 * dim * 4


def test_quanto_int4_layers_are_counted_from_the_packed_storage(tiny_lm, quanto):
    model = tiny_lm.model
    layers, heads, dim = _dims(model)
    cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=16, residual_length=2)
    _fill(model, cache, n=10, decode=3)  # the prompt is packed; 3 steps: flush at 2, then 1 in the residual
    state = kv.state(cache)
    residual = cache.layers[0].keys.shape[-2]
    packed = 13 - residual
    elements = heads * packed * dim
    groups = elements // 16
    per_tensor = math.ceil(groups / 2) * 16 + 2 * groups * 4  # two group rows per byte row; float32 scale, shift
    assert residual == 1
    assert state.bytes == layers * (2 * per_tensor + 2 * heads * residual * dim * 4)
    assert state.layers[0]["dtype"] == "qint4"


@pytest.mark.parametrize("backend,package", [("quanto", "optimum.quanto"), ("hqq", "hqq")])
def test_int4_arm_bytes_match_the_formula(tiny_lm, backend, package, request):
    pytest.importorskip(package)
    if backend == "quanto":
        request.getfixturevalue("quanto")
    specs = [f"int4:group=16,residual=4,backend={backend}", f"int2:group=16,residual=4,backend={backend}"]
    result = kvlab(tiny_lm, "Hello world, the quick brown fox", specs, max_new_tokens=6, temperature=0)
    for arm in result.arms:
        assert arm["steps"][0]["delta"] == 0  # the prefill attends with the unquantized states
        assert all(s["bytes"] == s["bytes_formula"] for s in arm["steps"])
        assert arm["summary"]["bytes_fraction"] < 0.5
    assert result.arms[1]["summary"]["bytes_final"] < result.arms[0]["summary"]["bytes_final"]


def test_sliding_window_model_keeps_transformers_rule_on_sliding_layers(tiny_tok):
    config = Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, sliding_window=6, use_sliding_window=True, max_window_layers=2,
                         max_position_embeddings=128, vocab_size=len(tiny_tok), eos_token_id=0,
                         pad_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    lm = LM.from_objects(Qwen2ForCausalLM(config).eval(), tiny_tok, source="tiny-sliding")
    result = kvlab(lm, "Hello world, the quick brown fox", ["full", "window:size=3"], max_new_tokens=6, temperature=0)
    full, window = result.arm("full"), result.arm("window")
    assert [s["logprob"] for s in full["steps"]] == [s.logprob for s in result.reference.steps]
    kinds = [layer["kind"] for layer in result.reference.steps[0].kv["layers"]]
    for step in window["steps"]:
        for layer, kept in enumerate(step["kept"]):
            assert kept == (3 if kinds[layer] == "full_attention" else 5)  # transformers keeps window - 1
        assert step["bytes"] == step["bytes_formula"]
