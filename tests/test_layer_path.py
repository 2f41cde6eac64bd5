"""lmtrace.model.layer_path: with `matmul="onednn"` each Llama decoder layer runs as one function
over the packed products. Its numbers are transformers' layer's own with those kernels, bit for bit
(a whole decode, the continuous batch, padded batches), and it steps aside wherever something
watches or changes a part of the layer (a hook, a replaced module, gradients)."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.decode.continuous import RowSpec, generate_rows
from lmtrace.model import layer_path, matmul
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from tests.tiny import tiny_model

PROMPTS = ["Hello world", "很久很久以前，", "a"]


@pytest.fixture
def own_tiny(tiny_tok) -> LM:
    lm = LM.from_objects(tiny_model(tiny_tok), tiny_tok, source="tiny")
    matmul.use(lm.model, "onednn")
    return lm


def _layers(lm: LM) -> list:
    return [m for m in lm.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def _logits(lm: LM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(torch.tensor([ids])).logits[0]


def test_every_layer_switched_and_described(own_tiny):
    assert all(layer_path.switched(x) for x in _layers(own_tiny))
    assert ", 2 decoder layers in one function" in matmul.describe(own_tiny.model)
    matmul.use(own_tiny.model, "default")
    assert not any(layer_path.switched(x) for x in _layers(own_tiny))


def test_decoding_equals_transformers_layer_bit_for_bit(own_tiny):
    """A batch of prompts of different lengths (padded) and the continuous batch: the same tokens
    and the same logprobs, exactly, as with transformers' own layer forward on the same kernels."""
    kw = {"max_new_tokens": 10, "temperature": 0, "top_logprobs": 5}
    p = SamplingParams(max_new_tokens=8, temperature=0, top_logprobs=3)
    specs = lambda: [RowSpec(lmtrace.encode_prompt(own_tiny, t), p, t) for t in PROMPTS]  # noqa: E731
    fast, fast_rows = lmtrace.generate(own_tiny, PROMPTS, **kw), generate_rows(own_tiny, specs())
    layer_path.remove(own_tiny.model)
    base, base_rows = lmtrace.generate(own_tiny, PROMPTS, **kw), generate_rows(own_tiny, specs())
    for a, b in [*zip(fast, base), *zip(fast_rows, base_rows)]:
        assert a.token_ids == b.token_ids
        assert [s.logprob for s in a.steps] == [s.logprob for s in b.steps]
        assert [s.entropy for s in a.steps] == [s.entropy for s in b.steps]


def test_the_function_really_runs(own_tiny, monkeypatch):
    """A call counted at the function (so the equality above is not transformers' forward twice)."""
    calls = []
    original = layer_path._norm
    monkeypatch.setattr(layer_path, "_norm", lambda *a: calls.append(1) or original(*a))
    _logits(own_tiny, [5, 6, 7])
    assert len(calls) == 2  # one per layer (the input's RMSNorm)


def test_a_layer_that_differs_on_the_probe_is_left_alone(own_tiny, monkeypatch):
    monkeypatch.setattr(layer_path, "_rotated", lambda x, emb: x * emb[0].unsqueeze(2))  # no rotate_half
    matmul.use(own_tiny.model, "onednn")
    assert not any(layer_path.switched(x) for x in _layers(own_tiny))
    assert matmul.describe(own_tiny.model).endswith(", 0 decoder layers in one function)")


def test_a_hook_on_a_part_is_honoured(own_tiny):
    """A forward hook on an MLP (as `intervene` zeroes one) runs and its change is in the numbers."""
    ids = [5, 6, 7, 8]
    before = _logits(own_tiny, ids)
    seen = []
    mlp = _layers(own_tiny)[0].mlp
    handle = mlp.register_forward_hook(lambda m, args, out: seen.append(1) or torch.zeros_like(out))
    try:
        hooked = _logits(own_tiny, ids)
        layer_path.remove(own_tiny.model)
        assert torch.equal(hooked, _logits(own_tiny, ids))  # transformers' layer with the same hook
    finally:
        handle.remove()
    assert seen and not torch.equal(hooked, before)


def test_a_replaced_part_is_used(own_tiny):
    layer = _layers(own_tiny)[1]
    ids = [5, 6, 7, 8]
    before = _logits(own_tiny, ids)
    zero = torch.nn.Module()
    zero.forward = lambda x: torch.zeros_like(x)  # an MLP that adds nothing
    layer.mlp = zero
    replaced = _logits(own_tiny, ids)
    layer_path.remove(own_tiny.model)
    assert torch.equal(replaced, _logits(own_tiny, ids)) and not torch.equal(replaced, before)


def test_gradients_go_through_transformers_forward(own_tiny):
    """With gradients on (attribution), the layer falls back: autograd works and the numbers agree."""
    ids = torch.tensor([[5, 6, 7]])
    embeds = own_tiny.model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = own_tiny.model(inputs_embeds=embeds).logits
    out[0, -1].max().backward()
    assert embeds.grad is not None and torch.count_nonzero(embeds.grad) > 0
    assert torch.allclose(out.detach()[0], _logits(own_tiny, [5, 6, 7]), atol=1e-5)
