from __future__ import annotations

import json

import numpy as np
import pytest

import lmtrace
from lmtrace import InvalidParameter, ModelLoadError


def small_gguf(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_loads_a_folder_and_summarises_it(tiny_dir):
    lm = lmtrace.load(tiny_dir)
    s = lm.summary
    assert (s.layers, s.attention_heads, s.kv_heads, s.head_dim, s.hidden_size) == (2, 4, 2, 16, 64)
    assert s.attention == "GQA (group size 2)" and s.dtype == "float32" and s.device == "cpu"
    assert s.parameters == sum(p.numel() for p in lm.model.parameters())
    assert s.context_length == 256 and s.vocab_size == 300
    assert lm.eos_token_ids == [lm.tokenizer.eos_token_id]


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        lmtrace.load(tmp_path / "nothing-here")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        lmtrace.load(tmp_path)


def test_pickle_only_folder_is_refused_with_the_flag_named(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError, match="allow_pickle=True"):
        lmtrace.load(tmp_path)


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="'vit' is not a causal language model"):
        lmtrace.load(tmp_path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(ModelLoadError, match=r"model.gguf: not a GGUF file"):
        lmtrace.load(bad)


def test_truncated_gguf(tmp_path):
    good = small_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut.gguf: corrupt or truncated GGUF file"):
        lmtrace.load(cut)


def test_a_file_that_is_not_gguf_by_name(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="must be a .gguf file"):
        lmtrace.load(f)


def test_uncached_hub_id_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        lmtrace.load("someone/no-such-model")


def test_bad_device_and_dtype(tiny_dir):
    with pytest.raises(InvalidParameter, match="device must be one of"):
        lmtrace.load(tiny_dir, device="tpu")
    with pytest.raises(InvalidParameter, match="dtype must be auto or one of"):
        lmtrace.load(tiny_dir, dtype="int3")


def test_dtype_is_applied(tiny_dir):
    lm = lmtrace.load(tiny_dir, dtype="bfloat16")
    assert lm.summary.dtype == "bfloat16"
    trace = lmtrace.generate(lm, "Hello", max_new_tokens=3, temperature=0)
    assert trace.model["dtype"] == "bfloat16" and len(trace.steps) == 3
