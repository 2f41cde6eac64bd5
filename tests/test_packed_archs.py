"""Every architecture transformers' GGUF loader supports (as a causal LM): a tiny random model,
its linear layers written to a GGUF file the way llama.cpp names them (gguf's own tensor-name
table for the file's architecture, `general.architecture` as llama.cpp writes it) in a Q4_K_M-
style mix of types, the model's weights set to gguf's dequantization of those blocks; then
`pack_gguf` must pack every linear layer the model holds, each checked equal to the loaded
weights (it compares them before the swap)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from lmtrace.model.gguf import packed
from lmtrace.model.gguf.quants import TYPES
from tests.test_packed import _unpermute

HIDDEN, FFN, HEADS, KV, VOCAB = 256, 512, 4, 2, 320
SIZES = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
             num_key_value_heads=KV, vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)  # fmt: skip
# transformers model_type -> (general.architecture in llama.cpp's files, config overrides)
ARCHS = {  # fmt: skip
    "llama": ("llama", {}),
    "mistral": ("llama", {}),  # llama.cpp writes Mistral models as "llama"
    "qwen2": ("qwen2", {}),
    "qwen2_moe": ("qwen2moe", {"num_experts": 4, "moe_intermediate_size": FFN, "shared_expert_intermediate_size": FFN,
                              "num_experts_per_tok": 2}),
    "qwen3": ("qwen3", {"head_dim": 64}),
    "qwen3_moe": ("qwen3moe", {"num_experts": 4, "moe_intermediate_size": FFN, "head_dim": 64,
                               "num_experts_per_tok": 2}),
    "gpt_oss": ("gpt-oss", {"num_local_experts": 4, "head_dim": 64, "num_experts_per_tok": 2}),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"]}),
    "falcon": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": KV}),
    "phi3": ("phi3", {}),
    "bloom": ("bloom", {"n_head": HEADS}),
    "stablelm": ("stablelm", {}),
    "gpt2": ("gpt2", {"n_positions": 128}),
    "starcoder2": ("starcoder2", {}),
    "mamba": ("mamba", {"time_step_rank": 32, "state_size": 16}),
    "nemotron": ("nemotron", {}),
    "gemma2": ("gemma2", {"head_dim": 64}),
    "gemma3_text": ("gemma3", {"head_dim": 64}),
    "gemma4_text": ("gemma4", {"head_dim": 64}),
    "minimax_m2": ("minimax-m2", {"num_local_experts": 4, "head_dim": 64, "num_experts_per_tok": 2}),
}


def _qtype(name: str, in_features: int) -> Q:
    """The types a Q4_K_M file mixes, by role (K-types need inputs a multiple of 256)."""
    k = in_features % 256 == 0
    if "attn_v" in name or name.startswith("token_embd"):
        return Q.Q8_0
    if "down" in name or name.startswith("output"):
        return Q.Q6_K if k else Q.Q5_1
    if "attn_output" in name or "ffn_up" in name:
        return Q.Q4_K if k else Q.Q4_0
    return Q.Q5_0


def _random_blocks(qtype: Q, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks with sane float16 scales (any bytes are valid codes)."""
    block, nbytes, *_ = TYPES[qtype.name]
    raw = rng.integers(0, 256, (out * inp // block, nbytes), dtype=np.uint8)
    fields = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2)}.get(qtype.name, (0,))
    for at in fields:
        raw[:, at : at + 2] = rng.uniform(1e-4, 2e-3, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(out, -1)


def _tiny(model_type: str, arch: str, overrides: dict, path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **{**SIZES, **overrides})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch)
    rng = np.random.default_rng(0)
    embed = model.get_input_embeddings()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        tied = module.weight is embed.weight
        key = names.get_name(name if not tied else next(n for n, m in model.named_modules() if m is embed))
        assert key is not None, f"{model_type}: gguf has no tensor name for {name}"
        qtype = _qtype(key, module.in_features)
        raw = _random_blocks(qtype, module.out_features, module.in_features, rng)
        back = dequantize(raw, qtype).reshape(module.out_features, module.in_features)
        writer.add_tensor(f"{key}.weight", raw, raw_dtype=qtype)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(_loaded(arch, key, back))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _loaded(arch: str, key: str, file_rows: np.ndarray) -> np.ndarray:
    """What transformers' loader makes of the file's rows."""
    if arch == "llama" and ".attn_q" in key:
        return _unpermute(file_rows, HEADS)
    if arch == "llama" and ".attn_k" in key:
        return _unpermute(file_rows, KV)
    if arch == "bloom" and "attn_qkv" in key:  # all q, all k, all v -> per head q, k, v
        return file_rows.reshape(3, HEADS, HIDDEN // HEADS, -1).swapaxes(0, 1).reshape(file_rows.shape)
    return file_rows


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_every_linear_layer_packs(model_type, tmp_path):
    arch, overrides = ARCHS[model_type]
    model = _tiny(model_type, arch, overrides, tmp_path / f"{model_type}.gguf")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    want = model(torch.tensor([[3, 5, 7, 11]])).logits if model_type != "mamba" else None
    report = packed.pack_gguf(model, tmp_path / f"{model_type}.gguf", compute_dtype=torch.float32)
    assert report.kept_float == {} and sorted(report.packed) == sorted(linears)
    assert report.architecture == arch
    if want is not None:
        with torch.inference_mode():
            got = model(torch.tensor([[3, 5, 7, 11]])).logits
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # float32 kernel: another summation order
