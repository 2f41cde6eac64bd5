"""The packed path (`weights="packed"`): GGUF Q4_0/Q4_1/Q8_0 blocks run by torch's int4 CPU
kernel. The oracle is gguf's own dequantization to float32 (what transformers loads): first on
single tensors, then on a tiny Llama written to a GGUF file here, then on the bundled model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM

from lmtrace.errors import InvalidParameter
from lmtrace.model import layer_path
from lmtrace.model.gguf import packed
from lmtrace.model.gguf.blocks import int4_form
from lmtrace.model.gguf.embedding import PackedEmbedding
from tests.cli_errors import one_error

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def _blocks(qtype: Q, out: int, inp: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(raw GGUF blocks, gguf's float32 dequantization (out, in)) of a random weight."""
    w = np.random.default_rng(seed).normal(0, 0.05, (out, inp)).astype(np.float32)
    w[0, :32] += 0.3  # a block whose minimum is far from zero (Q4_1's m)
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(out, inp).copy())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int4_form_is_ggufs_dequantization(qtype):
    raw, reference = _blocks(qtype, 64, 96)
    form = int4_form(qtype.name, raw, 64, 96)
    assert form.codes.min() >= 0 and form.codes.max() <= 15
    assert torch.equal(form.dequantize(), reference)  # bit for bit


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_multiplies_by_the_dequantized_weights(qtype):
    """The kernel's convention, (c - 8) * scale + zero per group of 32, read back through it:
    the identity matrix gives the weights themselves, exactly, in float32."""
    raw, reference = _blocks(qtype, 128, 64, seed=1)
    layer = packed.PackedLinear(int4_form(qtype.name, raw, 128, 64), None, torch.float32, qtype.name)
    assert torch.equal(layer(torch.eye(64)).t(), reference)
    x = torch.randn(3, 5, 64)  # (batch, seq, in): any leading shape
    want = torch.nn.functional.linear(x, reference)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    fast = packed.PackedLinear(int4_form(qtype.name, raw, 128, 64), None, torch.bfloat16, qtype.name)
    got = fast(x)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # bfloat16 input and scales


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_head_refines_the_top_logits_in_float32(qtype):
    """The lm_head's kernel output is bfloat16; its best `refine` logits per row are recomputed
    from the exact weights, so they equal float32 to rounding, the rest stay coarse."""
    raw, reference = _blocks(qtype, 256, 64, seed=2)
    form = int4_form(qtype.name, raw, 256, 64)
    head = packed.PackedHead(form, None, torch.bfloat16, qtype.name, refine=16, raw=raw.reshape(256, -1))
    x = torch.randn(2, 3, 64) * 4
    got, want = head(x), torch.nn.functional.linear(x, reference)
    top = want.topk(8, dim=-1).indices  # well inside the 16 refined ones
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() > 1e-4  # the tail is the coarse bfloat16 product


def test_unsupported_type_has_no_int4_form():
    with pytest.raises(ValueError, match="no packed form for Q2_K"):
        int4_form("Q2_K", np.zeros((4, 84), np.uint8), 4, 256)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes q/k in (transformers undoes it on load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}  # fmt: skip


def _tiny_gguf(path) -> LlamaForCausalLM:
    """A random tiny Llama (tied embeddings) whose linear weights are written to a GGUF file as
    Q4_1, Q4_0 and Q8_0 blocks (one as F16, which has no int4 form), and set in the model to
    gguf's dequantization of them: the state `load()` gives from such a file."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    writer = GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for hf, name in GGUF_NAMES.items():
                linear = layer.get_submodule(hf)
                qtype = Q.F16 if (i, name) == (1, "attn_v") else (Q.Q4_0 if name == "ffn_down" else Q.Q4_1)
                heads = {"attn_q": 4, "attn_k": 2}.get(name)
                w = linear.weight.numpy()
                w = _llama_cpp_permute(w, heads) if heads else w
                raw = w.astype(np.float16) if qtype == Q.F16 else quantize(w, qtype)
                writer.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=qtype)
                back = dequantize(raw, qtype).reshape(w.shape).astype(np.float32)
                linear.weight.copy_(torch.from_numpy(_unpermute(back, heads) if heads else back))
            for norm, name in ((layer.input_layernorm, "attn_norm"), (layer.post_attention_layernorm, "ffn_norm")):
                norm.weight.copy_(1 + 0.1 * torch.randn(64))
                writer.add_tensor(f"blk.{i}.{name}.weight", norm.weight.numpy().copy())
        model.model.norm.weight.copy_(1 + 0.1 * torch.randn(64))
        writer.add_tensor("output_norm.weight", model.model.norm.weight.numpy().copy())
        raw = quantize(model.model.embed_tokens.weight.numpy(), Q.Q8_0)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=Q.Q8_0)
        model.model.embed_tokens.weight.copy_(torch.from_numpy(dequantize(raw, Q.Q8_0).reshape(320, 64).copy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reverse of llama.cpp's q/k permutation."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_packed(tmp_path_factory):
    """(float model as loaded, the same model packed with float32 (lmtrace's C kernel) and bfloat16
    (torch's int4 kernel) activations, the bfloat16 one's report)."""
    import copy

    path = tmp_path_factory.mktemp("packed") / "tiny.gguf"
    model = _tiny_gguf(path)
    exact, fast = copy.deepcopy(model), copy.deepcopy(model)
    packed.pack_gguf(exact, path, compute_dtype=torch.float32)
    report = packed.pack_gguf(fast, path, compute_dtype=torch.bfloat16)
    return model, exact, fast, report


def test_every_quantized_linear_is_packed_and_the_rest_said(tiny_packed):
    model, exact, fast, report = tiny_packed
    assert report.packed["model.layers.0.self_attn.q_proj"] == "Q4_1"
    assert report.packed["model.layers.0.mlp.down_proj"] == "Q4_0"
    assert report.packed["lm_head"] == "Q8_0"  # tied to the embedding: the token_embd blocks
    assert set(report.kept_float) == {"model.layers.1.self_attn.v_proj"}
    assert "F16" in report.kept_float["model.layers.1.self_attn.v_proj"]
    assert len(report.packed) == 14 and "kept in float" in report.line()
    assert isinstance(fast.lm_head, packed.PackedHead) and not isinstance(exact.lm_head, packed.PackedHead)
    assert isinstance(fast.model.embed_tokens, torch.nn.Embedding)  # lookups stay float
    assert packed.report_of(fast) is report and packed.report_of(model) is None
    from lmtrace.model.arch import summarize

    want = "packed (Q4_0 x2, Q4_1 x11, Q8_0 x1), bfloat16 activations, torch's kernel; kept float: 1"
    assert summarize(fast.config, fast).weights == want
    assert summarize(fast.config, fast).parameters == summarize(model.config, model).parameters
    assert summarize(model.config, model).weights is None


def test_packed_model_against_its_dequantized_float32(tiny_packed):
    model, exact, fast, _ = tiny_packed
    ids = torch.randint(0, 320, (2, 12))
    with torch.inference_mode():
        want = torch.log_softmax(model(ids).logits.float(), -1)
        got_exact = torch.log_softmax(exact(ids).logits.float(), -1)
        got_fast = torch.log_softmax(fast(ids).logits.float(), -1)
    assert (got_exact - want).abs().max() < 1e-5  # the same weights, another summation order
    assert (got_fast - want).abs().max() < 0.05  # bfloat16 activations into the packed matmuls
    assert (got_fast.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_float_reference_rebuilds_the_float_model(tiny_packed):
    model, _, fast, _ = tiny_packed
    ref = packed.float_reference(fast)
    assert not any(isinstance(m, packed.PackedLinear) for m in ref.modules())
    assert packed.report_of(ref) is None
    ids = torch.randint(0, 320, (1, 9))
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, model(ids).logits)


def test_gguf_file_round_trip(tiny_packed, tmp_path):
    path = tmp_path / "one.gguf"
    raw, reference = _blocks(Q.Q4_1, 64, 128)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type == Q.Q4_1
    assert torch.equal(int4_form("Q4_1", tensor.data, 64, 128).dequantize(), reference)


def test_load_refuses_packed_without_a_gguf(tiny_dir):
    import lmtrace

    with pytest.raises(InvalidParameter, match="weights"):
        lmtrace.load(str(tiny_dir), weights="packed")
    with pytest.raises(InvalidParameter, match="weights must be one of"):
        lmtrace.load(str(tiny_dir), weights="int3")


@pytest.mark.integration
def test_bundled_packed_against_float32(bundled_packed, bundled_lm):
    """Every linear layer of the bundled Q4_1 file runs packed; greedy decoding agrees with the
    float32 path on the chosen tokens' logprobs within the bfloat16-activation cost."""
    import lmtrace

    report = packed.report_of(bundled_packed.model)
    assert len(report.packed) == 211 and not report.kept_float  # 30 layers x 7 + the Q8_0 lm_head
    prompt = "The capital of France is"
    got = lmtrace.generate(bundled_packed, prompt, max_new_tokens=8, temperature=0, top_logprobs=3)
    ids = lmtrace.encode_prompt(bundled_lm, prompt) + [s.token_id for s in got.steps]
    with torch.inference_mode():
        logits = bundled_lm.model(torch.tensor([ids])).logits[0, -len(got.steps) - 1 : -1].float()
    ref = torch.log_softmax(logits, -1)
    diffs = [abs(s.logprob - float(ref[i, s.token_id])) for i, s in enumerate(got.steps)]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.03
    assert got.steps[0].text == " Paris"


def test_verify_reports_the_packed_cost_against_float32(tiny_packed, tiny_tok):
    from lmtrace.model.lm import LM
    from lmtrace.scoring.teacher.verify import verify

    model, _, fast, _ = tiny_packed
    fast.generation_config.eos_token_id = tiny_tok.eos_token_id
    lm = LM.from_objects(fast, tiny_tok, source="tiny-packed")
    report = verify(lm, tiny_tok("Hello world")["input_ids"], max_new_tokens=6)
    d = report.to_dict()
    assert d["weights"] == "packed" and len(report.steps) >= 1
    assert 0 < d["float32_max_logprob_diff"] < 0.1
    assert 0 <= d["float32_mean_logprob_diff"] <= d["float32_max_logprob_diff"]
    assert 0 <= d["float32_top1_agreement"] <= 1
    assert report.first_divergence is None  # cached, uncached and model.generate: the same packed path


def test_cli_weights_packed_needs_a_gguf(capsys, tiny_dir):
    from lmtrace.cli import main

    code = main(["generate", "Hello", "--model", str(tiny_dir), "--weights", "packed"])
    err = capsys.readouterr().err
    assert code == 2
    assert one_error(err).startswith("lmtrace: error: weights: 'packed' runs a GGUF file's own quantized weights")


@pytest.mark.integration
@pytest.mark.usefixtures("shared_bundled")  # the command runs on the session's bundled_packed
def test_cli_verify_packed_on_the_bundled_model(capsys):
    """`lmtrace verify --weights packed` says what runs packed and what it costs against float32."""
    import json

    from lmtrace.cli import main

    code = main(["verify", "The capital of France is", "--weights", "packed", "--max-new-tokens", "4",
                 "--json", "-", "--no-color"])  # fmt: skip
    out = capsys.readouterr()
    d = json.loads(out.out)
    brief = {k: d[k] for k in ("ok", "max_logprob_diff", "first_divergence", "float32_mean_logprob_diff")}
    assert code == 0 and d["weights"] == "packed" and d["float32_top1_agreement"] == 1.0, brief
    assert "packed weights: 211 of 211 linear layers (Q4_1 x210, Q8_0 x1;" in out.err


@pytest.mark.parametrize("kernel", ["lmtrace-int4c", "torch-int4"])
def test_fused_mlp_gives_the_same_numbers(tiny_packed, kernel):
    """gate and up stacked into one kernel call: the same logits, bit for bit, as separate calls
    (either kernel), and float_reference still rebuilds the float model."""
    import copy

    from lmtrace.model.gguf.fused import FusedMLP

    model, exact, fast, report = tiny_packed
    together = exact if kernel == "lmtrace-int4c" else fast
    compute = torch.float32 if kernel == "lmtrace-int4c" else torch.bfloat16
    assert report.fused == 2 and all(isinstance(layer.mlp, FusedMLP) for layer in together.model.layers)
    assert type(together.model.layers[0].self_attn.q_proj) is packed.PackedLinear
    apart = copy.deepcopy(model)
    packed.pack_gguf(apart, report.path, compute_dtype=compute, fuse=False)
    assert not any(isinstance(m, FusedMLP) for m in apart.modules())
    ids = torch.randint(0, 320, (2, 7))
    layer_path.fuse(together, False)  # the small operations as torch does them (on lmtrace's kernel: in C)
    try:
        with torch.inference_mode():
            assert torch.equal(together(ids).logits, apart(ids).logits)
            assert torch.equal(together(ids[:1, :1]).logits, apart(ids[:1, :1]).logits)  # one token: a decode step
    finally:
        layer_path.fuse(together, True)


def test_a_file_with_nothing_to_pack_is_refused(tmp_path, tiny_tok, monkeypatch, capsys):
    """All of its matrices F16/F32: `--weights packed` says so in one line and exits 2, never
    running float32 weights under the packed name."""
    from lmtrace.cli import main
    from tests.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "f16.gguf", tiny_tok, qtype="F16")
    monkeypatch.setenv("LMTRACE_GGUF_CACHE", "0")
    code = main(["generate", "Hello", "--model", str(path), "--weights", "packed", "--max-new-tokens", "2"])
    err = one_error(capsys.readouterr().err)
    assert code == 2
    assert err.startswith("lmtrace: error: weights: 'packed' packs none of the 15 linear layers of f16.gguf")
    assert "F16: no packed form for F16" in err and "--weights float" in err


def test_packed_load_reads_the_file_straight_into_packed_form(tmp_path, tiny_tok, monkeypatch):
    """`load(weights="packed")` builds the model empty and fills it from the GGUF: packed layers
    from their blocks, the rest dequantized; the same logits, bit for bit, as packing the float32
    load, and no converted float32 copy is made."""
    import lmtrace
    from lmtrace.model.gguf import converted
    from tests.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok)
    monkeypatch.setenv("LMTRACE_CACHE", str(tmp_path / "cache"))
    direct = lmtrace.load(str(path), device="cpu", weights="packed")
    assert converted.ready_folder(path) is None  # nothing converted: only the config and tokenizer kept
    assert (converted.ready_meta(path) / "config.json").is_file()
    again = lmtrace.load(str(path), device="cpu", weights="packed")  # from the kept config and tokenizer
    assert again.tokenizer("Hello world")["input_ids"] == direct.tokenizer("Hello world")["input_ids"]
    monkeypatch.setenv("LMTRACE_GGUF_CACHE", "0")
    floats = lmtrace.load(str(path), device="cpu", dtype="float32")
    report = packed.pack_gguf(floats.model, path)
    assert packed.report_of(direct.model).packed == report.packed and len(report.packed) == 13
    ids = torch.tensor([tiny_tok("Hello world, this is a test")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(direct.model(ids).logits, floats.model(ids).logits)
    linears = [n for n, m in direct.model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]  # F32 in the file
    want = {n for n, _ in floats.model.named_parameters()} - {"model.embed_tokens.weight"}
    assert {n for n, _ in direct.model.named_parameters()} == want  # the norms, float
    embed = direct.model.get_input_embeddings()  # rows dequantized from the file's blocks when looked up
    assert isinstance(embed, PackedEmbedding) and direct.model.lmtrace_packed.embedding.endswith("when looked up")
    rows = torch.arange(embed.num_embeddings)
    assert torch.equal(embed.rows(rows), floats.model.get_input_embeddings().weight)


def test_packed_load_of_a_tied_model_packs_its_head(tmp_path, monkeypatch):
    """A file without output.weight (tied head, as most small models ship): the lm_head runs
    packed from token_embd's blocks (converted 64 rows at a time here, as a large head is) and the
    embedding's rows dequantized from the same tensor when looked up."""
    from transformers import LlamaConfig

    from lmtrace.model.gguf.direct import load_packed

    monkeypatch.setattr(packed, "CHUNK_ROWS", 64)
    path = tmp_path / "tied.gguf"
    model = _tiny_gguf(path)  # token_embd only, Q8_0
    config = LlamaConfig(**{k: v for k, v in model.config.to_dict().items() if k in LlamaConfig().to_dict()})
    direct = load_packed(config, path)
    report = packed.report_of(direct)
    assert report.packed["lm_head"] == "Q8_0" and set(report.kept_float) == {"model.layers.1.self_attn.v_proj"}
    embed = direct.model.embed_tokens
    assert isinstance(embed, PackedEmbedding) and embed.kind == "Q8_0"
    from lmtrace.inside.lens import unembedding

    assert unembedding(model).tied and unembedding(direct).tied  # the packed head and embedding: one GGUF tensor
    assert torch.equal(embed.rows(torch.arange(320)), model.model.embed_tokens.weight)
    assert torch.equal(embed(torch.tensor([[5, 7, 5]])), model.model.embed_tokens(torch.tensor([[5, 7, 5]])))
    reference = copy.deepcopy(model)
    packed.pack_gguf(reference, path)
    ids = torch.randint(0, 320, (1, 9))
    with torch.inference_mode():
        assert torch.equal(direct(ids).logits, reference(ids).logits)
    ref = packed.float_reference(direct)  # what verify and kld compare against: the float embedding back
    assert not any(isinstance(m, PackedEmbedding) for m in ref.modules())
    assert torch.equal(ref.get_input_embeddings().weight, model.model.embed_tokens.weight)
    with torch.inference_mode():
        assert torch.equal(ref(ids).logits, model(ids).logits)


def _decode_logits(model, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The prompt's logits, then `steps` greedy one-token steps on the cache: each step's logits."""
    from lmtrace.kv import ledger

    cache = ledger.new_cache(model)
    with torch.inference_mode():
        out = [model(ids, **ledger.cache_kwargs(model, cache)).logits]
        for _ in range(steps):
            out.append(model(out[-1][:, -1:].argmax(-1), **ledger.cache_kwargs(model, cache)).logits)
    return out


@pytest.mark.parametrize("which", [1, 2], ids=["float32-kernel", "bfloat16-kernel"])
def test_packed_layers_run_as_one_function_bit_for_bit(tiny_packed, which, monkeypatch):
    """Each Llama layer whose products all run packed is one function (lmtrace.model.layer_path):
    the prompt's and each decode step's logits equal transformers' layer forward, bit for bit. The
    second layer keeps a float v_proj (F16 in the file): it stays transformers' own. On lmtrace's
    kernel the layer's small operations then run in C: within float32 rounding of those logits."""
    model = tiny_packed[which]
    assert packed.report_of(model).layers == 1
    assert [layer_path.switched(x) for x in model.model.layers] == [True, False]
    assert packed.report_of(model).small_ops == (1 if which == 1 else 0)
    ids = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(3))
    calls, qkv = [], layer_path.PACKED.qkv
    monkeypatch.setattr(layer_path.PACKED, "qkv", lambda *a: calls.append(1) or qkv(*a))
    in_c = _decode_logits(model, ids, 4)
    layer_path.fuse(model, False)  # the function with torch's small operations
    try:
        fast = _decode_logits(model, ids, 4)
        assert len(calls) == 10  # the first layer, at the prompt and at each step, twice: the function ran
        layer_path.remove(model)
        base = _decode_logits(model, ids, 4)
    finally:
        assert layer_path.install(model) == 1
    assert all(torch.equal(a, b) for a, b in zip(fast, base))
    assert all(torch.allclose(a, b, rtol=0, atol=5e-5) for a, b in zip(in_c, base))
    assert all(torch.equal(a, b) for a, b in zip(in_c, base)) == (which == 2)  # torch's kernel: torch's bits


@pytest.mark.integration
def test_bundled_packed_decodes_as_one_function_bit_for_bit(bundled_packed):
    """The bundled model's 30 layers on their Q4_1 blocks: the same tokens, logprobs and entropies
    with the one-function layers (their small operations as torch does them) as with transformers'
    forward; with the small operations in C (lmtrace's kernel), the same tokens within 5e-5."""
    import lmtrace

    model = bundled_packed.model
    report = packed.report_of(model)
    assert report.layers == report.joined == report.small_ops == 30  # q/k/v one call, small operations in C
    kw = {"max_new_tokens": 12, "temperature": 0, "top_logprobs": 5}
    prompts = ["Once upon a time,", "很久很久以前，"]
    in_c = lmtrace.generate(bundled_packed, prompts, **kw)
    layer_path.fuse(model, False)
    try:
        fast = lmtrace.generate(bundled_packed, prompts, **kw)
        layer_path.remove(model)
        base = lmtrace.generate(bundled_packed, prompts, **kw)
    finally:
        assert layer_path.install(model) == 30
    for a, b, c in zip(fast, base, in_c):
        assert a.token_ids == b.token_ids == c.token_ids
        assert [s.logprob for s in a.steps] == [s.logprob for s in b.steps]
        assert [s.entropy for s in a.steps] == [s.entropy for s in b.steps]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(b.steps, c.steps)) <= 5e-5
