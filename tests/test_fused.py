"""--matmul onednn-fused (lmtrace.model.fused): oneDNN's products and a Llama layer's small
operations in C. Each kernel against torch's operations; whole decodes against the default path
(torch's kernel, transformers' layers) at the opt-in bound 5e-5 with every feature of the
composability table on the tiny model (the continuous batch and the bundled model: tests/test_matmul.py,
both kernels); the trace and the CLI name it; no compiler, or no Llama layer, is one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import lmtrace
from lmtrace import InvalidParameter
from lmtrace.cli import main
from lmtrace.model import layer_path, matmul
from lmtrace.model.arch import summarize
from lmtrace.model.fused import build, ops
from lmtrace.model.lm import LM
from tests import composability as world
from tests.same_record import one_thread  # noqa: F401
from tests.tiny import tiny_model
from tests.tiny_gguf import write_tiny_gguf

BOUND = 5e-5  # the opt-in kernel paths' bound against the default path


@pytest.fixture
def own_tiny(tiny_tok) -> LM:
    return LM.from_objects(tiny_model(tiny_tok), tiny_tok, source="tiny")


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_each_kernel_against_torch(rows):
    g = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, 1, 576, generator=g) * 3, torch.randn(rows, 1, 576, generator=g)
    w = torch.randn(576, generator=g)
    want = F.rms_norm(x, (576,), w, 1e-5)
    h, normed = ops.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(h, x + y)  # the residual stream exactly as torch adds it
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # torch's order of summing, its vector width
        assert torch.equal(ops.rms_norm(x, w, 1e-5), want)
        assert torch.equal(normed, F.rms_norm(x + y, (576,), w, 1e-5))
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert torch.allclose(normed, F.rms_norm(x + y, (576,), w, 1e-5), rtol=1e-6, atol=1e-5)
    gate_up = torch.randn(rows, 2 * 100, generator=g) * 5  # 100: 12 vector lanes of 8 and a tail of 4
    want = F.silu(gate_up[:, :100]) * gate_up[:, 100:]
    assert torch.allclose(ops.silu_mul(gate_up, 100), want, rtol=1e-6, atol=1e-6)


def test_rotary_is_transformers_to_the_bit():
    """q and k read in place from a q/k/v row (3 + 1 + 1 heads of 8), rotated: transformers'
    apply_rotary_pos_emb exactly."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 5, 5, 8, generator=g)
    cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    q, k = qkv[:, :, :3].transpose(1, 2), qkv[:, :, 3:4].transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = ops.rotary(qkv[:, :, :4], cos, sin)  # (b, s, 4 heads, 8)
    assert torch.equal(got[:, :, :3].transpose(1, 2), want_q)
    assert torch.equal(got[:, :, 3:].transpose(1, 2), want_k)


@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_against_sdpa(masked):
    """One query position, 9 query heads over 3 key/value heads, keys read in place from a cache
    with room (strided), some rows' first keys masked out (left padding): SDPA's result within
    float32 rounding, as transformers' sdpa attention returns it (b, 1, heads, d)."""
    g = torch.Generator().manual_seed(1)
    b, heads, kv, keys, d = 5, 9, 3, 21, 64
    q = torch.randn(b, 1, heads + 2 * kv, d, generator=g)[:, :, :heads].transpose(1, 2)
    k = torch.randn(b, kv, 32, d, generator=g)[:, :, :keys]
    v = torch.randn(b, kv, 32, d, generator=g)[:, :, :keys]
    mask = None
    if masked:
        mask = torch.ones(b, 1, 1, keys, dtype=torch.bool)
        mask[0, ..., :7], mask[3, ..., :20] = False, False
    assert ops.decodes(q, k, mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
    got = ops.decode_attention(q, k, v, mask, 0.125)
    assert got.shape == (b, 1, heads, d)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not ops.decodes(torch.randn(b, heads, 2, d), k, None)  # a prompt: SDPA's
    assert not ops.decodes(q, k, torch.zeros(b, 1, 1, keys))  # an additive float mask: SDPA's


def test_fused_greedy_equals_the_default_path(own_tiny):
    prompt = "Hello world"
    base = lmtrace.generate(own_tiny, prompt, max_new_tokens=16, temperature=0, top_logprobs=5)
    matmul.use(own_tiny.model, "onednn-fused")
    layers = own_tiny.model.config.num_hidden_layers
    assert layer_path.fused_layers(own_tiny.model) == layers
    assert matmul.describe(own_tiny.model).startswith("onednn-fused (")
    assert f"{layers} with RMSNorm, rotary, SiLU·mul and decode attention in C" in matmul.describe(own_tiny.model)
    fast = lmtrace.generate(own_tiny, prompt, max_new_tokens=16, temperature=0, top_logprobs=5)
    assert fast.token_ids == base.token_ids
    for a, b in zip(fast.steps, base.steps):
        assert abs(a.logprob - b.logprob) < BOUND and abs(a.entropy - b.entropy) < BOUND
        assert [x.token_id for x in a.top] == [x.token_id for x in b.top]
    assert summarize(own_tiny.model.config, own_tiny.model).matmul.startswith("onednn-fused (")


def test_the_kernels_really_run(own_tiny, monkeypatch):
    calls = []
    for name in ("rms_norm", "add_rms_norm", "silu_mul", "rotary", "decode_attention"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    matmul.use(own_tiny.model, "onednn-fused")
    calls.clear()
    lmtrace.generate(own_tiny, "Hi", max_new_tokens=2, temperature=0)
    layers = own_tiny.model.config.num_hidden_layers
    each = {n: 2 * layers for n in ("rms_norm", "add_rms_norm", "silu_mul", "rotary")}  # the prompt and one step
    assert {n: calls.count(n) for n in set(calls)} == each | {"decode_attention": layers}  # the step's
    matmul.use(own_tiny.model, "onednn")  # the exact function: only the kernels with torch's bits
    calls.clear()
    lmtrace.generate(own_tiny, "Hi", max_new_tokens=2, temperature=0)
    assert set(calls) == {"rms_norm", "add_rms_norm", "rotary"}
    assert "with RMSNorm and rotary in C (torch's bits)" in matmul.describe(own_tiny.model)
    matmul.use(own_tiny.model, "default")  # transformers' layers: no kernel
    calls.clear()
    lmtrace.generate(own_tiny, "Hi", max_new_tokens=2, temperature=0)
    assert calls == [] and layer_path.fused_layers(own_tiny.model) == 0


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory, tiny_tok):
    """The composability table's tiny GGUF model loaded twice: the default path and onednn-fused."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("fused") / "tiny.gguf", tiny_tok)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMTRACE_GGUF_CACHE", "0")
        base = lmtrace.load(str(path), device="cpu", dtype="float32")
        fused = lmtrace.load(str(path), device="cpu", dtype="float32", matmul="onednn-fused")
    assert layer_path.fused_layers(fused.model) == fused.model.config.num_hidden_layers
    return base, fused


def _record(lm, feature: str) -> dict:
    record = world.comparable(world.via_generate(lm, world.merged(feature)))
    record["model"]["config"].pop("matmul", None)
    return record


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("feature", list(world.FEATURES))
def test_fused_composes_with_every_feature(gguf_pair, feature):
    """Each row of the composability table on the fused path: the default path's record (token
    ids exactly, every number within 5e-5), or `compile` refused in one line naming both."""
    base, fused = gguf_pair
    if feature == "compile":
        with pytest.raises(InvalidParameter, match="compile.*matmul onednn-fused"):
            world.via_generate(fused, world.merged(feature))
        return
    want, got = _record(base, feature), _record(fused, feature)
    assert world.differences(got, want, BOUND) == []


def test_generate_onednn_fused_on_the_cli(capsys, tiny_dir, tmp_path):
    out = tmp_path / "t.json"
    args = ["--model", str(tiny_dir), "--matmul", "onednn-fused", "--max-new-tokens", "4", "--temperature", "0"]
    code = main(["generate", "Hello", *args, "--json", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["model"]["config"]["matmul"].startswith("onednn-fused (")
    assert "matmul: onednn-fused" in capsys.readouterr().err


def test_no_compiler_is_one_line(own_tiny, monkeypatch, tmp_path, capsys, tiny_dir):
    """Without a C compiler the fused path is refused naming it: the library, and the CLI (exit 2)."""
    monkeypatch.setenv("LMTRACE_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    build.library.cache_clear()
    try:
        with pytest.raises(InvalidParameter, match="matmul: 'onednn-fused' compiles its kernels with a C compiler"):
            matmul.use(own_tiny.model, "onednn-fused")
        assert main(["generate", "Hi", "--model", str(tiny_dir), "--matmul", "onednn-fused"]) == 2
        err = capsys.readouterr().err
        assert "onednn-fused" in err and "Traceback" not in err
        assert list(tmp_path.iterdir()) == []  # nothing half-written
        matmul.use(own_tiny.model, "onednn")  # the exact function still runs, on torch's operations
        assert layer_path.fused_layers(own_tiny.model) == 0 and "in C" not in matmul.describe(own_tiny.model)
    finally:
        build.library.cache_clear()


def test_a_model_without_llama_layers_is_refused():
    """Qwen2's decoder layers are not computed as one function: onednn-fused would be onednn, so
    it is refused in one line naming it, and the model keeps torch's kernel."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, num_hidden_layers=2, **sizes)).eval()
    refused = "'onednn-fused' computes the small operations of Llama.*Qwen2DecoderLayers"
    with pytest.raises(InvalidParameter, match=refused):
        matmul.use(model, "onednn-fused")
    assert matmul.describe(model) is None and not any(matmul.switched(m) for m in model.modules())
    assert matmul.use(model, "onednn") > 0  # its linear layers still go to oneDNN
