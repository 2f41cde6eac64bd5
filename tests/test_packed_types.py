"""Every packed GGUF type against gguf's own dequantization: a tensor written to a GGUF file by
the gguf package (quantized by `gguf.quants.quantize` where it can quantize the type, else raw
blocks of random bytes with sane float16 scales: any bytes are valid codes), read back by its
reader, then packed: the packed form's weights equal `gguf.quants.dequantize` bit for bit, and
the packed matmul (the kernel's float32 path) is within 1e-5 relative of the float32 matmul by
the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from lmtrace.model.gguf import packed
from lmtrace.model.gguf.blocks import int4_form
from lmtrace.model.gguf.quants import TYPES

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
PIECES = {"Q4_0": 1, "Q4_1": 1, "Q4_K": 1, "Q5_0": 2, "Q5_1": 2, "Q5_K": 2, "Q8_0": 2, "IQ4_NL": 2,
          "IQ4_XS": 2, "Q6_K": 4}  # fmt: skip
OUT, IN = 48, 512


def _raw(type_name: str, rng: np.random.Generator) -> np.ndarray:
    if type_name in QUANTIZABLE:
        w = rng.normal(0, 0.05, (OUT, IN)).astype(np.float32)
        w[0, :32] += 0.3  # a block far from zero (the offsets of Q4_1, Q5_1)
        return quantize(w, Q[type_name])
    block, nbytes, *_ = TYPES[type_name]
    raw = rng.integers(0, 256, (OUT * IN // block, nbytes), dtype=np.uint8)
    d = 10 ** rng.uniform(-5, -1, (raw.shape[0], 1))  # over four decades, as real files spread them
    at = 208 if type_name == "Q6_K" else 0
    raw[:, at : at + 2] = d.astype(np.float16).view(np.uint8)
    if type_name in ("Q4_K", "Q5_K"):  # dmin: a few times d, as llama.cpp's quantizer gives it
        raw[:, 2:4] = (d * rng.uniform(1, 16, d.shape)).astype(np.float16).view(np.uint8)
    return raw.reshape(OUT, -1)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{type: the tensor as the gguf reader gives it back}, all from one GGUF file."""
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name in TYPES:
        writer.add_tensor(f"t.{name}", _raw(name, rng), raw_dtype=Q[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name[2:]: t for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("type_name", list(TYPES))
def test_packed_weights_are_ggufs_dequantization(written, type_name):
    tensor = written[type_name]
    assert tensor.tensor_type.name == type_name
    want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(OUT, IN).copy())
    form = int4_form(type_name, tensor.data, OUT, IN)
    assert form.pieces == PIECES[type_name]
    assert form.codes.min() >= 0 and form.codes.max() <= 15
    assert torch.equal(form.dequantize(), want)  # bit for bit, float32


@pytest.mark.parametrize("type_name", list(TYPES))
def test_packed_matmul_is_the_dequantized_matmul(written, type_name):
    tensor = written[type_name]
    w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(OUT, IN).copy())
    layer = packed.PackedLinear(int4_form(type_name, tensor.data, OUT, IN), None, torch.float32, type_name)
    x = torch.randn(3, 4, IN, generator=torch.Generator().manual_seed(1))  # (batch, seq, in)
    want = torch.nn.functional.linear(x.double(), w.double()).float()
    got = layer(x)
    assert got.shape == (3, 4, OUT)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    fast = packed.PackedLinear(int4_form(type_name, tensor.data, OUT, IN), None, torch.bfloat16, type_name)
    assert ((fast(x) - want).abs().max() / want.abs().max()).item() < 0.03  # bfloat16 inputs and scales


@pytest.mark.parametrize("type_name", list(TYPES))
def test_lmtraces_kernel_makes_each_weight_ggufs_own_value(written, type_name):
    """On lmtrace's kernel a two-piece type, and Q6_K's four pieces, run as one piece of 8-bit codes
    (c * S + Z, one rounding; Q6_K with a scale per 16), so each weight is gguf's own value: a
    one-hot input reads it back, bit for bit, alone and among other rows."""
    tensor = written[type_name]
    want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(OUT, IN).copy())
    layer = packed.PackedLinear(int4_form(type_name, tensor.data, OUT, IN), None, torch.float32, type_name)
    if type_name in ("Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q6_K"):
        assert (layer.bits, layer.pieces, layer.group) == (8, 1, 16 if type_name == "Q6_K" else 32)
    assert layer.pieces == 1
    assert torch.equal(layer(torch.eye(IN)).t(), want)
    assert torch.equal(torch.cat([layer(torch.eye(IN)[k : k + 1]) for k in (0, 17, 300)]), want.t()[[0, 17, 300]])


def test_a_row_count_the_kernel_cannot_take_is_padded(written):
    """The kernel wants a multiple of 16 output rows: 5 rows run as 16, the extra ones weight 0."""
    tensor = written["Q4_K"]
    rows = tensor.data.reshape(OUT, -1)[:5]
    w = torch.from_numpy(dequantize(rows, Q.Q4_K).reshape(5, IN).copy())
    layer = packed.PackedLinear(int4_form("Q4_K", rows, 5, IN), None, torch.float32, "Q4_K")
    x = torch.randn(2, IN, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-6)


def test_q4_k_offsets_that_would_round_take_a_second_piece():
    """Q4_K's zero s * 8 - dmin * m is one float32 only when d and dmin are close in scale;
    else the offset rides on a piece of its own and the weights stay exact."""
    raw = np.zeros((1, 144), np.uint8)
    raw[0, 0:2] = np.array([1e-4], np.float16).view(np.uint8)  # d
    raw[0, 2:4] = np.array([3.0], np.float16).view(np.uint8)  # dmin, far above d
    raw[0, 4:16] = np.random.default_rng(3).integers(0, 256, 12, dtype=np.uint8)
    raw[0, 16:] = np.random.default_rng(4).integers(0, 256, 128, dtype=np.uint8)
    raw = np.repeat(raw, 16, axis=0)  # 16 rows of one block each
    form = int4_form("Q4_K", raw, 16, 256)
    assert form.pieces == 2
    assert torch.equal(form.dequantize(), torch.from_numpy(dequantize(raw, Q.Q4_K).reshape(16, 256).copy()))


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32], ids=["torch-int4", "lmtrace-int4c"])
def test_a_large_tensor_is_packed_in_row_chunks(written, monkeypatch, compute):
    """Rows converted CHUNK_ROWS at a time (torch's kernel packs 64-row blocks on their own, then a
    32-row tail; lmtrace's panels of 64 columns): the same packed buffers, and matmul, as the
    tensor converted whole, in either kernel's form."""
    from types import SimpleNamespace

    from lmtrace.model.gguf.names import Found

    tensor = SimpleNamespace(data=np.concatenate([written["Q5_0"].data] * 3), tensor_type=Q.Q5_0)  # 144 rows
    whole = packed.PackedLinear(int4_form("Q5_0", tensor.data, 3 * OUT, IN), None, compute, "Q5_0")
    monkeypatch.setattr(packed, "CHUNK_ROWS", 64)
    parts = list(packed._forms(Found(tensor, None), 3 * OUT, IN))
    assert [f.codes.shape[0] for f in parts] == [64, 64, 16]
    chunked = packed.PackedLinear(iter(parts), None, compute, "Q5_0", rows=3 * OUT)
    assert torch.equal(chunked.packed, whole.packed) and torch.equal(chunked.scale_zeros, whole.scale_zeros)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(0))
    assert torch.equal(chunked(x), whole(x))
    with pytest.raises(ValueError, match="multiple of 64"):  # 32-row chunks would be packed otherwise
        packed.PackedLinear(iter([parts[0], parts[2], parts[1]]), None, compute, "Q5_0", rows=3 * OUT)


def test_row_chunks_must_add_up_to_the_rows_announced(written, monkeypatch):
    """Chunks are copied into buffers made for `rows`: fewer or more rows than that is refused."""
    from lmtrace.model.gguf.names import Found

    monkeypatch.setattr(packed, "CHUNK_ROWS", 64)
    tensor = written["Q5_0"]
    for rows in (OUT - 16, OUT + 32):
        with pytest.raises(ValueError, match="rows"):
            packed.PackedLinear(packed._forms(Found(tensor, None), OUT, IN), None, torch.float32, "Q5_0", rows=rows)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_a_small_packed_matmul_on_one_thread_gives_the_same_bits(written, type_name, monkeypatch):
    """Below SERIAL_WORK the kernel runs on one thread (no thread wake-up per small layer): the
    same output, bit for bit, as on all threads, for one row and for a prefill's many."""
    layer = packed.PackedLinear(int4_form(type_name, written[type_name].data, OUT, IN), None, torch.bfloat16, type_name)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 7):
            x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
            monkeypatch.setattr(packed, "SERIAL_WORK", 0)
            parallel = layer(x)
            monkeypatch.setattr(packed, "SERIAL_WORK", 1 << 40)
            assert torch.equal(layer(x), parallel) and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
