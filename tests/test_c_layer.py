"""A packed Llama layer on lmtrace's kernel as two C calls a step (lmtrace/model/fused/layer.c): the
same operations as lmtrace.model.layer_path makes one by one, so the same numbers to the bit; made
only where the layer's shape allows, and dropped where its parts change."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.model import layer_c
from lmtrace.model.fused import layer as c_layer
from tests.tiny_gguf import PANELS, write_tiny_gguf

PROMPTS = ["hello there", "a longer prompt, padded on the left of the other"]


@pytest.fixture(scope="module")
def panels(tmp_path_factory, tiny_tok):
    path = tmp_path_factory.mktemp("c_layer") / "tiny.gguf"
    write_tiny_gguf(path, tiny_tok, qtype="Q4_1", dims=PANELS, float_q=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMTRACE_GGUF_CACHE", "0")
        return lmtrace.load(str(path), device="cpu", dtype="float32", weights="packed")


def _decode(lm, **kw):
    return lmtrace.generate(lm, PROMPTS, max_new_tokens=6, temperature=0, top_logprobs=5, stop_on_eos=False, **kw)


def _same(a, b) -> bool:
    return all(
        x.token_ids == y.token_ids and [s.logprob for s in x.steps] == [s.logprob for s in y.steps]
        and [s.entropy for s in x.steps] == [s.entropy for s in y.steps]
        for x, y in zip(a, b)
    )  # fmt: skip


def _without_c(lm):
    """The layers' C forms set aside: layer_path's calls one by one."""
    return {layer: layer.__dict__.pop("_lmtrace_c") for layer in lm.model.model.layers}


def test_two_calls_give_the_layer_paths_numbers_bit_for_bit(panels, monkeypatch):
    calls = []
    rest = c_layer.CLayer.rest
    monkeypatch.setattr(c_layer.CLayer, "rest", lambda self, *a: calls.append(1) or rest(self, *a))
    in_c = _decode(panels)
    assert len(calls) == 2 * 5  # both layers at each of the 5 decode steps after the prompt's
    saved = _without_c(panels)
    try:
        one_by_one = _decode(panels)
    finally:
        for layer, form in saved.items():
            layer.__dict__["_lmtrace_c"] = form
    assert len(calls) == 10 and _same(in_c, one_by_one)


def test_the_c_form_is_dropped_where_the_layers_parts_change(panels):
    """A product's buffers replaced: the layer no longer runs its C form (it would read the old ones)."""
    layer = panels.model.model.layers[0]
    down = layer.mlp.down_proj
    assert layer_c.c_form(layer) is not None
    kept = down.packed
    down.packed = kept.clone()
    try:
        assert layer_c.c_form(layer) is None
        assert _same(_decode(panels), _decode(panels))
    finally:
        down.packed = kept
    assert layer_c.c_form(layer) is not None


def test_made_only_for_whole_panels(tmp_path, tiny_tok, monkeypatch):
    """The default tiny file's k/v are 32 columns: q/k/v are not joined and no layer has a C form
    (the layer path's calls one by one, its small operations still in C)."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok, qtype="Q4_1", float_q=False)
    monkeypatch.setenv("LMTRACE_GGUF_CACHE", "0")
    lm = lmtrace.load(str(path), device="cpu", dtype="float32", weights="packed")
    report = lm.model.lmtrace_packed
    assert report.joined == 0 and report.small_ops == 2
    assert all(layer.__dict__.get("_lmtrace_c") is None for layer in lm.model.model.layers)


def test_a_copied_model_runs_its_layers_call_by_call(panels):
    """A deep copy (as `lmtrace verify` makes) holds no C form pointing at the original's tensors."""
    import copy

    twin = copy.deepcopy(panels.model)
    assert all(layer.__dict__.get("_lmtrace_c") is None for layer in twin.model.layers)
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.inference_mode():
        assert torch.equal(twin(ids).logits, panels.model(ids).logits)


def test_serve_weights_packed(monkeypatch, tmp_path, tiny_tok, capsys):
    """`lmtrace serve --weights packed` serves the file's packed weights on lmtrace's kernel (the
    completion's logprobs those of `lmtrace.generate` on the same load); `--weights packed --compile`
    loads too (lmtrace's kernel compiles), and with --server a client refuses --weights in one line."""
    from fastapi.testclient import TestClient

    from lmtrace.cli import main

    monkeypatch.setenv("LMTRACE_GGUF_CACHE", "0")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok, qtype="Q4_1", dims=PANELS, float_q=False)
    apps = []
    monkeypatch.setattr("lmtrace.server.run.Runner.run", lambda runner: apps.append(runner.server.config.app))
    assert main(["serve", "--model", str(path), "--weights", "packed"]) == 0
    assert main(["serve", "--model", str(path), "--weights", "packed", "--compile"]) == 0
    assert "packed weights: 15 of 15 linear layers" in capsys.readouterr().err
    lm = apps[0].state.lmtrace.lm
    assert lm.model.lmtrace_packed.kernel == "lmtrace's"
    body = {"model": apps[0].state.lmtrace.name, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0,
            "logprobs": 1, "ignore_eos": True}  # fmt: skip
    got = TestClient(apps[0]).post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    want = lmtrace.generate(lm, PROMPTS[0], max_new_tokens=5, temperature=0, stop_on_eos=False)
    assert got == [s.logprob for s in want.steps]
    assert main(["generate", "hi", "--server", "http://127.0.0.1:9", "--weights", "packed"]) == 2
    assert "weights: --weights applies to a model loaded here" in capsys.readouterr().err
