"""Attention over the cache: the captured weights are eager attention's (mean over heads, the
last query row), columns map to absolute positions (sliding-window layers and left padding
included), and capturing changes no logit."""

from __future__ import annotations

import copy

import pytest
import torch

import lmtrace
from lmtrace.inside import attention
from tests.tiny_archs import ARCHS, tiny_arch

PROMPTS = ["Hello world, the quick brown", "很久"]  # the second row is left-padded in the batch


@pytest.fixture(scope="module", params=ARCHS)
def arch_lm(request, tiny_tok):
    return request.param, tiny_arch(request.param, tiny_tok)


def _eager_rows(lm, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the last query's weights over positions 0..len-1 (mean over heads), from
    transformers' own eager attention on an unpadded copy of the model."""
    model = copy.deepcopy(lm.model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return [a[0, :, -1, :].float().mean(0) for a in out.attentions]  # (heads, q, kv) -> (kv,)


def _dense(layer: dict, n: int) -> torch.Tensor:
    w = torch.zeros(n)
    for t in layer["top"]:
        w[t["position"]] = t["weight"]
    return w


def test_weights_equal_eager_attention_at_absolute_positions(arch_lm):
    arch, lm = arch_lm
    # top_logprobs above the sequence length: every attended position is listed
    traces = lmtrace.generate(lm, PROMPTS, max_new_tokens=6, temperature=0, top_logprobs=30, attention=True)
    windows = getattr(lm.model.config, "layer_types", None) or []
    for trace in traces:
        seq = trace.prompt["token_ids"] + trace.token_ids
        for i, step in enumerate(trace.steps):
            n = len(trace.prompt["token_ids"]) + i  # positions the step's query sees
            oracle = _eager_rows(lm, seq[:n])
            layers = step.attention["layers"]
            assert [x["layer"] for x in layers] == list(range(len(oracle)))
            for rec, want in zip(layers, oracle):
                assert all(0 <= t["position"] < n for t in rec["top"])  # padding never shows
                assert all(t["token_id"] == seq[t["position"]] for t in rec["top"])
                assert (_dense(rec, n) - want).abs().max() < 1e-6
                assert rec["sink_mass"] == pytest.approx(want[: attention.SINKS].sum().item(), abs=1e-6)
                assert rec["recent_mass"] == pytest.approx(want[-attention.RECENT :].sum().item(), abs=1e-6)
                ent = -torch.special.xlogy(want, want).sum().item()
                assert rec["entropy"] == pytest.approx(ent, abs=1e-5)
            for rec, kind in zip(layers, windows):
                if kind == "sliding_attention" and n > 4:  # only the window's positions
                    assert {t["position"] for t in rec["top"]} <= set(range(n - 4, n))


def test_per_head_weights_equal_eager_attention_and_average_to_the_layer(arch_lm):
    """attention="heads": each head's record is that head's own row of eager attention's
    weights; their mean is the layer's record; the tokens and logprobs do not change."""
    arch, lm = arch_lm
    kw = {"max_new_tokens": 4, "temperature": 0, "top_logprobs": 30}
    heads = lmtrace.generate(lm, PROMPTS, attention="heads", **kw)
    plain = lmtrace.generate(lm, PROMPTS, attention=True, **kw)
    model = copy.deepcopy(lm.model)
    model.set_attn_implementation("eager")
    for trace, mean in zip(heads, plain):
        assert [s.logprob for s in trace.steps] == [s.logprob for s in mean.steps]
        seq = trace.prompt["token_ids"] + trace.token_ids
        for i, step in enumerate(trace.steps):
            n = len(trace.prompt["token_ids"]) + i
            with torch.no_grad():
                oracle = model(torch.tensor([seq[:n]]), output_attentions=True).attentions
            for rec, same, want in zip(step.attention["layers"], mean.steps[i].attention["layers"], oracle):
                assert {k: v for k, v in rec.items() if k != "heads"} == same  # the mean is unchanged
                assert [h["head"] for h in rec["heads"]] == list(range(want.shape[1]))
                for h in rec["heads"]:
                    w = want[0, h["head"], -1].float()
                    assert (_dense(h, n) - w).abs().max() < 1e-6
                    assert all(t["token_id"] == seq[t["position"]] and "text" in t for t in h["top"])
                    assert h["sink_mass"] == pytest.approx(w[: attention.SINKS].sum().item(), abs=1e-6)
                    assert h["entropy"] == pytest.approx(-torch.special.xlogy(w, w).sum().item(), abs=1e-5)
    assert heads[0].params["attention"]["heads"] == "mean and per head"


def _value_weighted_oracle(lm, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, by hand from eager attention's weights and the cache's values: at head h the
    last query's α_hj·‖v_j‖ (v_j of h's KV head, float32) renormalised over j, then the mean over
    heads. A plain DynamicCache keeps every position's values, sliding-window layers' too."""
    from transformers import DynamicCache

    from lmtrace.kv import ledger as kv

    model = copy.deepcopy(lm.model)
    model.set_attn_implementation("eager")
    cache = DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, **kv.cache_kwargs(model, cache))
    rows = []
    for a, layer in zip(out.attentions, cache.layers):
        w = a[0, :, -1, :].float()  # (heads, q, kv) -> (heads, kv)
        norms = layer.values[0].float().norm(dim=-1)  # (kv_heads, kv_len, dim) -> (kv_heads, kv_len)
        norms = norms.repeat_interleave(w.shape[0] // norms.shape[0], dim=0)  # -> (heads, kv_len)
        scaled = w * norms
        rows.append((scaled / scaled.sum(-1, keepdim=True)).mean(0))
    return rows


def test_value_weighted_attention_equals_a_hand_computation(arch_lm):
    """value_weighted at every step and layer, against eager attention's weights times the norms
    of the cache's value vectors (GQA, sliding windows and a left-padded row included)."""
    arch, lm = arch_lm
    traces = lmtrace.generate(lm, PROMPTS, max_new_tokens=4, temperature=0, top_logprobs=30, attention=True)
    for trace in traces:
        seq = trace.prompt["token_ids"] + trace.token_ids
        for i, step in enumerate(trace.steps):
            n = len(trace.prompt["token_ids"]) + i
            for rec, want in zip(step.attention["layers"], _value_weighted_oracle(lm, seq[:n]), strict=True):
                vw = rec["value_weighted"]
                assert all(t["token_id"] == seq[t["position"]] and "text" in t for t in vw["top"])
                assert (_dense(vw, n) - want).abs().max() < 1e-5, (arch, i, rec["layer"])
                assert vw["sink_mass"] == pytest.approx(want[: attention.SINKS].sum().item(), abs=1e-5)
                assert vw["entropy"] == pytest.approx(-torch.special.xlogy(want, want).sum().item(), abs=1e-4)


def test_value_weighted_discounts_a_position_with_a_small_value(tiny_lm):
    """The arithmetic itself: a position with a tiny value vector keeps its raw weight but loses
    its value-weighted share."""
    weights = torch.tensor([[[0.7, 0.2, 0.1]]])  # (batch, heads, kv_len)
    value = torch.tensor([[[[0.01, 0.0], [1.0, 0.0], [0.0, 2.0]]]])  # (batch, kv_heads, kv_len, dim)
    got = attention.value_weighted(weights, value)[0, 0]
    want = torch.tensor([0.007, 0.2, 0.2]) / 0.407
    assert torch.allclose(got, want) and got[0] < 0.02


def test_attention_other_than_true_false_or_heads_is_refused(tiny_lm):
    with pytest.raises(lmtrace.InvalidParameter, match="attention must be true, false or 'heads', got 'all'"):
        lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, attention="all")


def test_capturing_changes_no_logit_and_restores_the_model(arch_lm):
    _, lm = arch_lm
    before = lm.model.config._attn_implementation
    kw = dict(max_new_tokens=6, temperature=0.8, seed=5, top_logprobs=3)
    plain = lmtrace.generate(lm, PROMPTS, **kw)
    seen = lmtrace.generate(lm, PROMPTS, **kw, attention=True, lens=True)
    for a, b in zip(plain, seen):
        assert a.token_ids == b.token_ids
        assert [s.logprob for s in a.steps] == [s.logprob for s in b.steps]
        assert [[x.logprob for x in s.top] for s in a.steps] == [[x.logprob for x in s.top] for s in b.steps]
    assert lm.model.config._attn_implementation == before
    assert not any(hasattr(m, "_lmtrace_attention") for m in lm.model.modules())


def test_attention_record_shape(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=3, temperature=0, attention=True)
    layer = trace.steps[1].attention["layers"][0]
    assert set(layer) == {"layer", "top", "sink_mass", "recent_mass", "entropy", "value_weighted"}
    assert list(layer["top"][0]) == ["position", "token_id", "text", "weight"]
    assert set(layer["value_weighted"]) == {"top", "sink_mass", "entropy"}
    assert list(layer["value_weighted"]["top"][0]) == ["position", "token_id", "text", "weight"]
    assert trace.params["attention"]["sinks"] == attention.SINKS
    assert lmtrace.Trace.from_json(trace.to_json()).to_dict() == trace.to_dict()


def test_compile_with_lens_is_refused(tiny_lm):
    with pytest.raises(lmtrace.InvalidParameter, match="compile"):
        lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, compile=True, lens=True)
