"""lmtrace's own C kernel for packed GGUF layers (lmtrace/model/fused/int4.c): float32 inputs, the
exact weights; each output element computed one way whatever the rows or threads of the call;
opaque inside torch.compile; and, without a C compiler, torch's kernels as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from lmtrace.errors import InvalidParameter
from lmtrace.model.fused import build, ops
from lmtrace.model.gguf import nibbles, packed
from lmtrace.model.gguf.blocks import int4_form
from tests import composability as world

OUT, IN = 40, 352  # 11 groups of 32: an odd count, and a vector's worth of groups plus a tail


def _layer(type_name: str, compute: torch.dtype = torch.float32) -> tuple[packed.PackedLinear, torch.Tensor]:
    """(a packed layer of `type_name`, its dequantized float32 weight)."""
    w = np.random.default_rng(0).normal(0, 0.05, (OUT, IN)).astype(np.float32)
    raw = quantize(w, Q[type_name])
    weight = torch.from_numpy(dequantize(raw, Q[type_name]).reshape(OUT, IN).copy())
    return packed.PackedLinear(int4_form(type_name, raw, OUT, IN), None, compute, type_name), weight


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_1"])  # 1 and 2 pieces
def test_the_float32_product_of_the_exact_weights(type_name):
    layer, w = _layer(type_name)
    assert layer.own_kernel and "int4.c" in repr(layer)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    want = (x.double() @ w.double().t()).float()
    got = layer(x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5  # float32 rounding
    coarse, _ = _layer(type_name, torch.bfloat16)  # torch's kernel rounds inputs to bfloat16: far coarser
    assert ((coarse(x) - want).abs().max() / want.abs().max()).item() > 1e-4


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_each_row_the_same_alone_in_a_batch_or_on_threads(monkeypatch, type_name):
    """Calls of 4 rows or more share the codes' unpacking and go in blocks of 6, 4 and 1 to 3 rows; a
    row's sums never depend on the block, the batch or the threads the columns are split over."""
    layer, _ = _layer(type_name)
    x = torch.randn(17, IN, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    for i in range(7):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 13, 16):  # every mix of blocks
        assert torch.equal(layer(x[1 : 1 + rows]), together[1 : 1 + rows]), rows
    monkeypatch.setattr(ops, "SERIAL_WORK", {True: 1, False: 1})  # every call on all of torch's threads
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert torch.equal(layer(x), together)
    finally:
        torch.set_num_threads(threads)


def test_compiled_as_one_opaque_operation():
    layer, _ = _layer("Q4_0")
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))


def test_no_compiler_keeps_torchs_kernels(monkeypatch, tmp_path):
    """Without a C compiler: float32 layers run torch's scalar int4 path (the same weights, within
    float32 rounding), and a packed load's default is torch's bfloat16 kernel, as before."""
    monkeypatch.setenv("LMTRACE_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    build.library.cache_clear()
    try:
        assert not nibbles.kernel_available() and packed.default_compute() == torch.bfloat16
        layer, w = _layer("Q4_1")
        assert not layer.own_kernel and "torch int4" in repr(layer)
        x = torch.randn(2, IN, generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-5, atol=1e-6)
        assert list(tmp_path.iterdir()) == []  # nothing half-written
    finally:
        build.library.cache_clear()


def _sized(out: int, seed: int) -> packed.PackedLinear:
    w = np.random.default_rng(seed).normal(0, 0.05, (out, IN)).astype(np.float32)
    return packed.PackedLinear(int4_form("Q4_1", quantize(w, Q.Q4_1), out, IN), None, torch.float32, "Q4_1")


def test_joined_qkv_give_each_layer_its_own_numbers():
    """q/k/v made views of one pair of buffers: one call gives each layer's output as it gives it
    alone, bit for bit; a layer replaced, or its buffers moved, and they are no longer joined."""
    from lmtrace.model.gguf.joined import Joined, joinable, joined_of

    layers = [_sized(128, 5), _sized(64, 6), _sized(64, 7)]
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(5))
    alone = [layer(x) for layer in layers]
    assert joinable(layers) and not joinable([*layers, _sized(40, 8)])  # 40: not whole panels
    attention = torch.nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = layers
    attention._lmtrace_qkv = joined = Joined(layers)
    assert joined_of(attention) is joined and joined.codes.data_ptr() == layers[0].packed.data_ptr()
    assert torch.equal(joined.product(x), torch.cat(alone, 1))
    assert all(torch.equal(layer(x), want) for layer, want in zip(layers, alone))  # each on its views
    attention.v_proj = _sized(64, 7)
    assert joined_of(attention) is None
    attention.v_proj = layers[2]
    layers[2].packed = layers[2].packed.clone()
    assert joined_of(attention) is None


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory, tiny_tok):
    """The composability table's tiny GGUF model (heads of 64, whole panels: its packed layers run
    as two C calls a step) loaded twice: the default float32 path and packed (on lmtrace's kernel)."""
    import lmtrace
    from tests.tiny_gguf import PANELS, write_tiny_gguf

    path = tmp_path_factory.mktemp("int4") / "tiny.gguf"
    write_tiny_gguf(path, tiny_tok, qtype="Q4_1", dims=PANELS, float_q=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMTRACE_GGUF_CACHE", "0")
        base = lmtrace.load(str(path), device="cpu", dtype="float32")
        fast = lmtrace.load(str(path), device="cpu", dtype="float32", weights="packed")
    assert fast.model.lmtrace_packed.compute_dtype == "float32"
    short = fast.model.lmtrace_packed.short()
    assert short == "packed (Q4_1 x15), float32 activations, lmtrace's kernel, 2 layers' small operations in C"
    assert all(layer.__dict__.get("_lmtrace_c") is not None for layer in fast.model.model.layers)
    return base, fast


def _record(lm, feature: str) -> dict:
    args = dict(world.BASE) if feature == "plain" else world.merged(feature)
    record = world.comparable(world.via_generate(lm, args))
    record["model"]["config"].pop("weights", None)  # "packed (Q4_1 x…), float32 activations": how it ran
    return record


@pytest.mark.parametrize("feature", ["plain", *world.FEATURES])
def test_packed_is_the_float32_path_with_every_feature(gguf_pair, feature):
    """Packed on lmtrace's kernel is an exact path: with each feature of the composability table,
    the default float32 path's record of the same file (token ids exactly, every number within
    5e-5, the opt-in kernel bound); attribution, which reads the head's weight matrix, refused in
    one line naming packed weights."""
    base, fast = gguf_pair
    if feature == "attribution":
        with pytest.raises(InvalidParameter, match="attribution needs an lm_head with a weight matrix.*packed"):
            world.via_generate(fast, world.merged(feature))
        return
    want, got = _record(base, feature), _record(fast, feature)
    assert world.differences(got, want, 5e-5) == []


def test_packed_in_the_continuous_batch(gguf_pair):
    """The server's continuous batch on the packed model: each row as the float32 path of the same
    file gives it alone (tokens exactly, logprobs within 5e-5)."""
    import lmtrace
    from lmtrace.decode.continuous import RowSpec, generate_rows
    from lmtrace.params import SamplingParams

    base, fast = gguf_pair
    prompts = ["Hello world", "很久很久以前，", "a"]
    p = SamplingParams(max_new_tokens=6, temperature=0, top_logprobs=2)
    rows = generate_rows(fast, [RowSpec(lmtrace.encode_prompt(fast, t), p, t) for t in prompts])
    for prompt, row in zip(prompts, rows):
        alone = lmtrace.generate(base, prompt, max_new_tokens=6, temperature=0, top_logprobs=2, stop_on_eos=True)
        assert row.token_ids == alone.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(row.steps, alone.steps)) <= 5e-5
