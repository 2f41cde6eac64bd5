"""The KV views on a model with mixed layer types (Gemma-3 style: sliding layers beside full
ones): the cache and kv-size views, the formula, the per-token growth and the shape line count
each kind of layer right, against the real cache transformers builds; and they fit 80 columns."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import lmtrace
from lmtrace.cli import main
from lmtrace.kv import size as kvsize
from lmtrace.render import anatomy
from lmtrace.render.terminal.kv import steps_view
from tests.test_anatomy import plain
from tests.test_terminal_80 import check_80
from tests.tiny_archs import gemma3_config, tiny_gemma3

TYPES = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2  # layers 0-2, 4-5 slide
WINDOW = 4
# Gemma 3 270M's cache layout: 18 layers, 15 sliding over 512 positions, one KV head of 256
GEMMA3_270M = (["sliding_attention"] * 5 + ["full_attention"]) * 3


@pytest.fixture(scope="module")
def lm(tiny_tok):
    return tiny_gemma3(tiny_tok, TYPES, WINDOW)


@pytest.fixture(scope="module")
def trace(lm):
    return lmtrace.generate(lm, "Hello world, the quick brown fox", max_new_tokens=5, temperature=0)


def real_cache(model, ids: list[int]) -> DynamicCache:
    """The cache transformers itself builds for `ids` (the oracle)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def nbytes(cache: DynamicCache) -> int:
    return sum(x.keys.numel() * x.keys.element_size() * 2 for x in cache.layers)


def test_steps_view_counts_each_shape_by_its_layers(lm, trace):
    ids = trace.prompt["token_ids"] + [s.token_id for s in trace.steps]
    seen = len(trace.prompt["token_ids"]) + len(trace.steps) - 1  # the last step's cache
    cache = real_cache(lm.model, ids[:seen])
    shapes = Counter(tuple(x.keys.shape) for x in cache.layers)
    assert shapes == {(1, 1, WINDOW - 1, 16): 5, (1, 1, seen, 16): 1}
    text = plain(steps_view([s.kv for s in trace.steps]))
    last = [line for line in text.splitlines() if line.strip().startswith(str(len(trace.steps) - 1))][-1]
    assert f"1 × [1, 1, {seen}, 16]" in last and f"5 × [1, 1, {WINDOW - 1}, 16]" in last
    assert "6 ×" not in text


def test_formula_growth_and_shape_line_equal_the_real_cache(lm, trace):
    an = trace.kv_anatomy
    positions, measured = anatomy.last_kv(trace.to_dict()["steps"])
    ids = trace.prompt["token_ids"] + [s.token_id for s in trace.steps]
    before, after = real_cache(lm.model, ids[: positions - 1]), real_cache(lm.model, ids[:positions])
    assert measured == nbytes(after)
    f = anatomy.formula(an, positions, measured)
    assert f.numbers == f"2 × 1 × 16 × 4 × 1 × (1 × {positions} + 5 × {WINDOW - 1})"
    assert f.result.startswith(f"{nbytes(after):,} bytes") and "min(positions, window − 1)" in f.symbols
    growth = nbytes(after) - nbytes(before)  # one full layer grows once every window is full
    assert growth == 2 * 16 * 4 and an["bytes_per_token_full"] == growth and an["bytes_per_token"] == 6 * growth
    assert f"at {positions} positions: +{growth} B per token" in f.per_position
    line = anatomy.shape_line(an, positions)
    assert f"1 full layer (1, 1, {positions}, 16)" in line and f"5 sliding layers (1, 1, {WINDOW - 1}, 16)" in line
    dims = {d.name: (d.value, d.source) for d in anatomy.dimensions(an, positions)}
    assert dims["sliding-window layers"] == ("5 of 6", "layers 0–2, 4–5; window 4: they hold window − 1 = 3 positions")
    page = anatomy.html(an, positions, measured)
    assert "5 sliding layers" in page and "(1, 1, 3, 16)" in page


def test_the_calculator_equals_the_real_cache_while_and_after_the_windows_fill(tiny_tok):
    config = gemma3_config(len(tiny_tok), tiny_tok.eos_token_id, tiny_tok.pad_token_id, TYPES, WINDOW)
    an = kvsize.anatomy(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, len(tiny_tok), (12,)).tolist()
    sizes = [0] + [nbytes(real_cache(model, ids[:n])) for n in range(1, 12)]
    for n in range(1, 12):
        assert an.bytes_at(n) == sizes[n]
        assert an.growth_at(n) == sizes[n] - sizes[n - 1]
    assert "5 sliding layers × 1 kv_heads × 16 head_dim × min(positions, 3)" in an.formula()
    assert "1 full layers × 1 kv_heads × 16 head_dim × positions" in an.formula()


def gemma3_270m(tmp_path, tiny_tok):
    config = gemma3_config(len(tiny_tok), tiny_tok.eos_token_id, tiny_tok.pad_token_id, GEMMA3_270M, 512, 256)
    config.save_pretrained(tmp_path)
    return config


def test_kv_size_of_a_gemma3_270m_layout_at_80_columns(capsys, monkeypatch, tmp_path, tiny_tok):
    config = gemma3_270m(tmp_path, tiny_tok)
    lines = check_80(capsys, monkeypatch, "kv-size", tmp_path / "config.json", "--context", "672", "--no-color")
    text = "\n".join(lines)
    assert "36.00 KiB per token while the windows fill, then 6.00 KiB per token" in text
    assert "+6.00 KiB per token at context 672" in text
    assert "3 full layers (1, 1, 672, 256), 15 sliding layers" in " ".join(x.strip() for x in lines)
    row = next(line for line in lines if "sliding-window layers" in line)
    assert len(row.split("15 of 18", 1)[1].strip()) >= 30  # the explanation column keeps its width
    # the total against the real cache of a model with that layout, filled to 672 positions
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, len(tiny_tok), (672,)).tolist()
    before, at = nbytes(real_cache(model, ids[:671])), nbytes(real_cache(model, ids))
    assert main(["kv-size", str(tmp_path / "config.json"), "--context", "672", "--json", str(tmp_path / "s.json")]) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["total_bytes"] == at == 2 * 4 * 256 * (3 * 672 + 15 * 511)
    assert result["bytes_per_token"] == 36 * 1024 and result["bytes_per_token_full"] == 6 * 1024
    assert result["growth_at_context"] == at - before == 6 * 1024


def test_cache_at_80_columns_on_a_sliding_window_model(capsys, monkeypatch, tmp_path, lm):
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    lines = check_80(capsys, monkeypatch, "cache", "Hello world, the quick brown fox", "--model", tmp_path,
                     "--max-new-tokens", "4", "--temperature", "0", "--no-color")  # fmt: skip
    text = " ".join(line.strip() for line in lines)
    assert "5 of 6" in text and "then 128 B per token" in text and "5 × [1, 1, 3, 16]" in text


def test_the_report_header_names_the_sliding_layers(lm, trace):
    from lmtrace.render.html.facts import model_group

    assert lm.summary.sliding == "5 of 6 layers, window 4"
    rows = dict(model_group(trace.to_dict()["model"])[1])
    assert rows["sliding window"] == "5 of 6 layers, window 4" and rows["layers"] == "6"
