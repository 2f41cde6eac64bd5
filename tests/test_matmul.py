"""--matmul onednn (lmtrace.model.matmul): the float32 linear layers through oneDNN on weights packed
once. Against transformers on a tiny model of its own (the shared one is left alone) and against
torch's kernel on the bundled model: the same greedy tokens, logprobs within the batched-versus-alone
bound (5e-5), an edited weight packed again, bad input one line."""

from __future__ import annotations

import json

import pytest
import torch

import lmtrace
from lmtrace import InvalidParameter
from lmtrace.cli import main
from lmtrace.model import matmul
from lmtrace.model.arch import summarize
from lmtrace.model.lm import LM
from tests.oracle import hf_greedy
from tests.tiny import tiny_model

BOUND = 5e-5  # a batch against one row alone: the same float noise of another summation order


@pytest.fixture
def own_tiny(tiny_tok) -> LM:
    return LM.from_objects(tiny_model(tiny_tok), tiny_tok, source="tiny")


def test_onednn_greedy_equals_generate(own_tiny):
    prompt = "Hello world"
    ids = lmtrace.encode_prompt(own_tiny, prompt)
    hf_ids, hf_logits = hf_greedy(own_tiny, ids, 16)  # torch's own kernel
    switched = matmul.use(own_tiny.model, "onednn")
    assert switched == sum(type(m) is torch.nn.Linear for m in own_tiny.model.modules())
    trace = lmtrace.generate(own_tiny, prompt, max_new_tokens=16, temperature=0, top_logprobs=5)
    assert trace.token_ids == hf_ids
    hf_lp = torch.log_softmax(hf_logits, -1)
    worst = max(abs(s.logprob - hf_lp[i, s.token_id].item()) for i, s in enumerate(trace.steps))
    assert worst < BOUND
    assert summarize(own_tiny.model.config, own_tiny.model).matmul.startswith("onednn (")


def test_onednn_really_runs_another_kernel(own_tiny):
    """The switched layer's output is oneDNN's own: equal to the op called by hand, bit for bit."""
    layer = next(m for m in own_tiny.model.modules() if type(m) is torch.nn.Linear)
    x = torch.randn(3, 5, layer.in_features)
    matmul.use(own_tiny.model, "onednn")
    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 8)
    by_hand = torch.ops.mkldnn._linear_pointwise(x.reshape(15, -1), packed, layer.bias, "none", [], "")
    with torch.inference_mode():
        assert torch.equal(layer(x), by_hand.reshape(3, 5, -1))
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_an_edited_weight_is_packed_again(own_tiny):
    layer = next(m for m in own_tiny.model.modules() if type(m) is torch.nn.Linear)
    matmul.use(own_tiny.model, "onednn")
    x = torch.randn(2, layer.in_features)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: the tensor's version moves
    with torch.inference_mode():
        assert torch.allclose(layer(x), 2 * before, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # a new tensor
    with torch.inference_mode():
        assert torch.count_nonzero(layer(x) - (layer.bias if layer.bias is not None else 0)) == 0


def test_default_puts_torch_back(own_tiny):
    matmul.use(own_tiny.model, "onednn")
    matmul.use(own_tiny.model, "default")
    assert not any("forward" in vars(m) for m in own_tiny.model.modules() if type(m) is torch.nn.Linear)
    assert matmul.describe(own_tiny.model) is None
    assert "matmul" not in summarize(own_tiny.model.config, own_tiny.model).to_dict()


def test_bad_matmul_is_one_line(own_tiny):
    with pytest.raises(InvalidParameter, match="matmul must be one of default, onednn, onednn-fused, got 'mkl'"):
        matmul.use(own_tiny.model, "mkl")
    with pytest.raises(InvalidParameter, match="matmul"):
        lmtrace.load(matmul="fast")
    own_tiny.model.to(torch.bfloat16)
    with pytest.raises(InvalidParameter, match="matmul: 'onednn' runs float32 linear layers"):
        matmul.use(own_tiny.model, "onednn")


def test_serve_refuses_an_unknown_matmul(capsys):
    assert main(["serve", "--matmul", "fast"]) == 2
    err = capsys.readouterr().err
    assert "--matmul" in err and "fast" in err and "Traceback" not in err


@pytest.mark.parametrize("kernel", ["onednn", "onednn-fused"])
def test_bundled_onednn_equals_torch_kernel(bundled_lm, kernel):
    """The bundled model, 4 prompts decoded as one batch: the same greedy tokens as torch's kernel,
    logprobs within the batched-versus-alone bound (measured 8 prompts x 32 tokens: 3.0e-5; with the
    small operations in C, onednn-fused, 2.5e-5 to 2.9e-5)."""
    prompts = ["The capital of France is", "很久很久以前，", "def fib(n):", "Why is the sky blue?"]
    base = lmtrace.generate(bundled_lm, prompts, max_new_tokens=12, temperature=0, top_logprobs=5)
    try:
        matmul.use(bundled_lm.model, kernel)
        fast = lmtrace.generate(bundled_lm, prompts, max_new_tokens=12, temperature=0, top_logprobs=5)
    finally:
        matmul.use(bundled_lm.model, "default")
    for a, b in zip(base, fast):
        assert a.token_ids == b.token_ids
        assert max(abs(s.logprob - t.logprob) for s, t in zip(a.steps, b.steps)) < BOUND
        assert [x.token_id for x in a.steps[0].top] == [x.token_id for x in b.steps[0].top]


@pytest.mark.parametrize(("extra", "named"), [(["--server", "http://127.0.0.1:9"], "server: --matmul onednn"),
                                              (["--compile"], "compile: --compile")])  # fmt: skip
def test_generate_matmul_pairs_refused(capsys, extra, named):
    assert main(["generate", "Hi", "--matmul", "onednn", *extra]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_generate_matmul_onednn_on_the_cli(capsys, tiny_dir, tmp_path):
    out = tmp_path / "t.json"
    code = main(["generate", "Hello", "--model", str(tiny_dir), "--matmul", "onednn", "--max-new-tokens", "4",
                 "--temperature", "0", "--json", str(out)])  # fmt: skip
    assert code == 0
    trace = json.loads(out.read_text())
    assert trace["model"]["config"]["matmul"].startswith("onednn (")
    assert "matmul: onednn" in capsys.readouterr().err


def _attention(model):
    return next(m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj"))


def test_siblings_computed_in_one_call_equal_each_alone(own_tiny):
    """q/k/v and gate/up are grouped; each part equals the layer's own product, bit for bit."""
    matmul.use(own_tiny.model, "onednn")
    assert "groups" in matmul.describe(own_tiny.model)
    att = _attention(own_tiny.model)
    layers = [att.q_proj, att.k_proj, att.v_proj]
    assert all(m._lmtrace_group is layers[0]._lmtrace_group is not None for m in layers)
    x = torch.randn(2, 3, att.q_proj.in_features)
    with torch.inference_mode():
        together = [m(x) for m in layers]  # the first call computes all three
        alone = [torch.ops.mkldnn._linear_pointwise(x.reshape(6, -1), torch.ops.mkldnn._reorder_linear_weight(
            m.weight.detach(), 8), m.bias, "none", [], "").reshape(2, 3, -1) for m in layers]  # fmt: skip
        for t, a, m in zip(together, alone, layers):
            assert torch.equal(t, a)
            assert torch.allclose(t, torch.nn.functional.linear(x, m.weight, m.bias), atol=1e-5)
        y = torch.randn_like(x)
        assert torch.equal(att.q_proj(x), together[0])
        assert torch.allclose(att.k_proj(y), torch.nn.functional.linear(y, att.k_proj.weight), atol=1e-5)


def test_a_grouped_layer_edited_is_packed_again(own_tiny):
    matmul.use(own_tiny.model, "onednn")
    att = _attention(own_tiny.model)
    x = torch.randn(2, att.k_proj.in_features)
    with torch.inference_mode():
        before = [att.q_proj(x), att.k_proj(x), att.v_proj(x)]
    with torch.no_grad():
        att.k_proj.weight.mul_(3.0)
    with torch.inference_mode():
        after = [att.q_proj(x), att.k_proj(x), att.v_proj(x)]
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    assert torch.allclose(after[1], 3 * before[1], atol=1e-5)


@pytest.mark.parametrize("extra", [{"draft": "layers:1", "draft_tokens": 2}, {"regex": "[a-c]{2,4}-[0-9]{1,3}"},
                                   {"lens": True, "attention": True}, {"temperature": 0.8, "seed": 3}],
                         ids=["draft", "regex", "lens+attention", "sampled"])  # fmt: skip
def test_onednn_composes_with_each_option(own_tiny, extra):
    """With a draft, a grammar, the lens and attention, or sampling: the same tokens as torch's
    kernel with the same option, numbers within the batched-versus-alone bound."""
    kw = {"max_new_tokens": 8, "temperature": 0, "top_logprobs": 3, **extra}
    base = lmtrace.generate(own_tiny, "Once upon a time", **kw)
    matmul.use(own_tiny.model, "onednn")
    fast = lmtrace.generate(own_tiny, "Once upon a time", **kw)
    assert fast.token_ids == base.token_ids
    for a, b in zip(fast.steps, base.steps):
        assert abs(a.logprob - b.logprob) < BOUND and abs(a.sampled_logprob - b.sampled_logprob) < BOUND
        if extra.get("lens"):
            assert [x["top"][0]["token_id"] for x in a.lens["layers"]] == [x["top"][0]["token_id"]
                                                                          for x in b.lens["layers"]]  # fmt: skip
            assert abs(a.lens["layers"][-1]["chosen_logprob"] - a.logprob) < 1e-6
            assert a.attention is not None
        if extra.get("regex"):
            assert a.grammar == b.grammar or abs(a.grammar["removed_mass"] - b.grammar["removed_mass"]) < BOUND


@pytest.mark.parametrize("kernel", ["onednn", "onednn-fused"])
def test_onednn_in_the_continuous_batch(own_tiny, kernel):
    """The server's continuous batch on a switched model: each row as torch's kernel gives it."""
    from lmtrace.decode.continuous import RowSpec, generate_rows
    from lmtrace.params import SamplingParams

    prompts = ["Hello world", "很久很久以前，", "a"]
    p = SamplingParams(max_new_tokens=6, temperature=0)
    specs = lambda: [RowSpec(lmtrace.encode_prompt(own_tiny, t), p, t) for t in prompts]  # noqa: E731
    base = generate_rows(own_tiny, specs())
    matmul.use(own_tiny.model, kernel)
    for a, b in zip(generate_rows(own_tiny, specs()), base):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.steps, b.steps)) < BOUND
