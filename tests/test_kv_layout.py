"""The KV formula's per-layer layout equals the measured cache layer by layer (full, grouped,
sliding on every layer, on some layers, Gemma-3-style mixed), whatever shape transformers'
`get_layer_types_and_kwargs` has: a kwargs dict per layer (5.18 on), one dict for all layers
(5.1-5.17: read as a list, a full-attention model's empty dict counted a layer per type), or
none at all (5.0: the layers DynamicCache builds are read). tests/test_kv.py holds the totals
to a hand formula; `make test-transformers-range` runs both files on the lowest transformers
pyproject.toml allows and on the vllm extra's."""

from __future__ import annotations

import pytest
import transformers.cache_utils as cache_utils

import lmtrace
from lmtrace.kv import ledger
from lmtrace.model.lm import LM
from tests.test_kv import MODELS
from tests.tiny_archs import tiny_gemma3

GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def model_named(name: str, tok):
    if name == "gemma3 mixed":
        return tiny_gemma3(tok, GEMMA3_TYPES, window=5).model
    return MODELS[name]()


NAMES = [*MODELS, "gemma3 mixed"]


@pytest.mark.parametrize("name", NAMES)
def test_expected_equals_measured_bytes_per_layer(tiny_tok, name):
    model = model_named(name, tiny_tok)
    lm = LM.from_objects(model, tiny_tok, source=name)
    trace = lmtrace.generate(lm, "Hello world, the quick brown", max_new_tokens=8, temperature=0, stop_on_eos=False)
    specs = ledger.layer_layout(model.config)
    assert trace.kv_anatomy["mismatches"] == []
    for step in trace.steps:
        seen = step.kv["seq_len"]
        assert len(step.kv["layers"]) == len(specs) and step.kv["bytes"] == step.kv["expected_bytes"] > 0
        for spec, layer in zip(specs, step.kv["layers"]):
            assert layer["kind"] == spec.kind and layer["window"] == spec.window
            assert layer["bytes"] == 2 * spec.kv_heads * spec.head_dim * spec.held(seen) * 4, (layer, spec)


def one_dict(native):
    """transformers 5.1-5.17's shape: the same kwargs for every layer, in one dict."""

    def shaped(config):
        types, per_layer = native(config)
        if isinstance(per_layer, dict):  # this transformers answers so already
            return types, per_layer
        merged: dict = {}
        for kwargs in per_layer:
            merged.update(kwargs)
        return types, merged

    return shaped


@pytest.mark.parametrize("name", NAMES)
def test_layout_reads_every_shape_of_transformers_answer(tiny_tok, name, monkeypatch):
    config = model_named(name, tiny_tok).config
    native = ledger.layer_layout(config)
    assert native and all(spec.kind in (ledger.FULL, ledger.SLIDING) for spec in native)
    text = config.get_text_config(decoder=True)
    types, kwargs = ledger.built_layers(text)  # 5.0's path: the layers the cache builds
    assert len(types) == len(native) == len(kwargs)
    assert [k["sliding_window"] for k in kwargs] == [s.window for s in native]
    if hasattr(cache_utils, "get_layer_types_and_kwargs"):
        monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", one_dict(cache_utils.get_layer_types_and_kwargs))
        assert ledger.layer_layout(config) == native


def test_a_failed_kv_self_check_exits_1(tiny_dir, tmp_path, capsys, monkeypatch):
    """`lmtrace generate` whose measured KV bytes differ from the formula shows and writes the
    trace, then ends with one `lmtrace: error:` line and exit code 1 (never `error:` and 0);
    `lmtrace render` of that trace says it as a warning (the check failed when it was made)."""
    from lmtrace.cli import main
    from lmtrace.decode import engine

    real = engine.expected_bytes
    monkeypatch.setattr(engine, "expected_bytes", lambda m, b: lambda s: real(m, b)(s) + 1)
    path = tmp_path / "t.json"
    args = ["generate", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "2", "--temperature", "0"]
    assert main([*args, "--no-color", "--json", str(path)]) == 1
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("lmtrace: error: measured KV bytes differ from the formula at steps [0, 1]")
    assert "error:" not in out and path.exists()
    assert main(["render", str(path), "--no-color"]) == 0
    out, err = capsys.readouterr()
    assert "warning: measured KV bytes differ from the formula at steps [0, 1]" in " ".join(out.split())
    assert "error" not in out + err
