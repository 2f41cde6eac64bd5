"""The stability ledger on the tiny model: each variant's numbers equal an independent plain
forward of the variant's model, its first divergence equals model.generate under the variant,
the per-step margin / sigma / risk / flagged follow their definitions, and a variant that
cannot run here is reported skipped with its reason."""

from __future__ import annotations

import math

import pytest
import torch

import lmtrace
from lmtrace.decode.engine import left_pad, positions
from lmtrace.scoring.stability import noise
from lmtrace.scoring.stability.ledger import first_divergence
from lmtrace.scoring.variants import spec as variant_spec
from lmtrace.scoring.variants.worlds import BatchWorld
from tests.same_record import one_thread  # noqa: F401
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "Once upon a time there was"
TOL = 1e-4


@pytest.fixture(scope="module")
def lm(tiny_dir):
    return lmtrace.load(str(tiny_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, lm):
    """The tiny model with its weights moved a little: 'another quantization' of it."""
    path = tmp_path_factory.mktemp("tiny-other")
    model = lmtrace.load(lm.source, device="cpu", dtype="float32").model
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.abs().mean())
    model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def result(lm, other_dir):
    variants = ["dtype:bfloat16", "dtype:float16", "attention:eager", "batch:3", "threads:2", f"model:{other_dir}",
                "weights:packed", "attention:flash_attention_2"]  # fmt: skip
    return lmtrace.stability(lm, PROMPT, variants, temperature=0, max_new_tokens=12, runs=2)


def plain(model, ids: list[int], first: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, first - 1 : -1].float(), -1)


def along(lp: torch.Tensor, tokens: list[int]) -> list[float]:
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def independent(lm, spec: str, ids: list[int], first: int) -> torch.Tensor:
    """The variant's model teacher-forced in a plain forward, built without lmtrace.scoring."""
    kind, _, value = spec.partition(":")
    if kind == "dtype":
        return plain(lmtrace.load(lm.source, device="cpu", dtype=value).model, ids, first)
    if kind == "model":
        return plain(lmtrace.load(value, device="cpu", dtype="float32").model, ids, first)
    if kind == "attention":
        other = lmtrace.load(lm.source, device="cpu", dtype="float32").model
        other.set_attn_implementation(value)
        return plain(other, ids, first)
    if kind == "threads":
        before = torch.get_num_threads()
        torch.set_num_threads(int(value))
        try:
            return plain(lm.model, ids, first)
        finally:
            torch.set_num_threads(before)
    rows = [ids, *BatchWorld(lm, variant_spec.parse_variant(spec)).others(len(ids))]
    assert max(map(len, rows)) > len(ids)  # the prompt's row is padded
    input_ids, mask = left_pad(rows, lm.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        logits = lm.model(input_ids=input_ids, attention_mask=mask, position_ids=positions(mask)).logits[0]
    return torch.log_softmax(logits[input_ids.shape[1] - len(ids) + first - 1 : -1].float(), -1)


def test_each_variants_numbers_equal_an_independent_forward(lm, result):
    ref = result.reference
    ids, tokens = ref.prompt["token_ids"], ref.token_ids
    base = plain(lm.model, ids + tokens, len(ids))
    top1, top2 = [s.top[0].token_id for s in ref.steps], [s.top[1].token_id for s in ref.steps]
    checked = 0
    for v in result.variants:
        if v["status"] != "ran":
            continue
        lp = independent(lm, v["variant"], ids + tokens, len(ids))
        assert [s["index"] for s in v["steps"]] == list(range(len(tokens)))
        for s, x, b, a1, a2, row in zip(v["steps"], along(lp, tokens), along(base, tokens), top1, top2, lp):
            assert abs(s["logprob"] - x) <= TOL and abs(s["delta"] - (x - b)) <= TOL, (v["variant"], s)
            assert s["flipped"] == (int(row.argmax()) != a1) and s["top_token_id"] == int(row.argmax())
            gap = float(row[a1] - row[a2]) - float(base[s["index"], a1] - base[s["index"], a2])
            assert abs(s["margin_change"] - gap) <= TOL
        deltas = [abs(s["delta"]) for s in v["steps"]]
        assert v["max_abs_delta"] == max(deltas) and v["flips"] == sum(s["flipped"] for s in v["steps"])
        checked += 1
    assert checked == 6


def hf_tokens(model, rows: list[list[int]], lm, n: int) -> list[int]:
    """Row 0's greedy tokens from model.generate on a left-padded batch, cut at its end token."""
    input_ids, mask = left_pad(rows, lm.pad_token_id, torch.device("cpu"))
    out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=n, top_k=None, top_p=None,
                         eos_token_id=lm.eos_token_ids, pad_token_id=lm.pad_token_id)  # fmt: skip
    tokens = out[0, input_ids.shape[1] :].tolist()
    for i, t in enumerate(tokens):
        if t in lm.eos_token_ids:
            return tokens[: i + 1]
    return tokens


def test_first_divergence_equals_model_generate_under_the_variant(lm, result, other_dir):
    ids, tokens = result.reference.prompt["token_ids"], result.reference.token_ids
    assert hf_tokens(lm.model, [ids], lm, 12) == tokens
    models = {"dtype:bfloat16": lmtrace.load(lm.source, device="cpu", dtype="bfloat16").model,
              f"model:{other_dir}": lmtrace.load(str(other_dir), device="cpu", dtype="float32").model}  # fmt: skip
    batch = [ids, *BatchWorld(lm, variant_spec.parse_variant("batch:3")).others(len(ids))]
    expected = {spec: first_divergence(tokens, hf_tokens(m, [ids], lm, 12)) for spec, m in models.items()}
    expected["batch:3"] = first_divergence(tokens, hf_tokens(lm.model, batch, lm, 12))
    for spec, div in expected.items():
        v = result.variant(spec)
        assert v["first_divergence"] == div, spec
        same = len(tokens) if div is None else div
        assert v["token_ids"][:same] == tokens[:same]
    assert expected[f"model:{other_dir}"] is not None  # the moved weights do diverge: a real case


def test_the_ledger_follows_its_definitions(result):
    ran = [v for v in result.variants if v["status"] == "ran"]
    levels = [math.sqrt(sum(s["margin_change"] ** 2 for s in v["steps"]) / len(v["steps"])) for v in ran]
    for i, (row, step) in enumerate(zip(result.steps, result.reference.steps)):
        assert row["index"] == i and row["token_id"] == step.token_id
        assert row["margin"] == pytest.approx(step.top[0].logprob - step.top[1].logprob)
        changes = [max(abs(v["steps"][i]["margin_change"]), lv) for v, lv in zip(ran, levels)]
        assert row["sigma"] == pytest.approx(max(changes), rel=1e-9)
        assert row["risk"] == pytest.approx(row["margin"] / row["sigma"])
        assert row["flagged"] == (row["margin"] < result.threshold * row["sigma"])
        flipped = [v["variant"] for v in ran if v["steps"][i]["flipped"]]
        assert row["flipped_in"] == flipped
        if flipped:  # a flip moves the gap by at least the margin: every observed flip is flagged
            assert row["flagged"]
    d = result.to_dict()
    assert {"reference", "variants", "steps"} <= set(d)
    assert all({"variant", "first_divergence", "steps", "max_abs_delta"} <= set(v) for v in d["variants"])
    assert all({"index", "margin", "sigma", "risk", "flagged"} <= set(s) for s in d["steps"])
    assert result.runs == [{"run": 1, "first_divergence": None, "max_abs_delta": 0.0, "identical": True}]


def test_variants_that_cannot_run_here_are_skipped_with_their_reason(result):
    packed = result.variant("weights:packed")
    assert packed["status"] == "skipped" and ".gguf" in packed["reason"] and packed["steps"] == []
    flash = result.variant("attention:flash_attention_2")
    assert flash["status"] == "skipped" and "flash_attention_2" in flash["reason"]
    assert all(v["status"] == "ran" for v in result.variants if v not in (packed, flash))


def test_an_engine_that_is_missing_is_skipped(lm):
    def missing(lm, spec):
        raise lmtrace.InvalidParameter("engine: --engine vllm needs vLLM (No module named 'vllm')")

    registered = variant_spec.engine("vllm")
    variant_spec.register_engine("vllm", missing)
    try:
        r = lmtrace.stability(lm, "Hi", "engine:vllm", temperature=0, max_new_tokens=3)  # one spec as a string
    finally:
        variant_spec.register_engine("vllm", registered)
    assert r.variants[0]["status"] == "skipped" and "No module named 'vllm'" in r.variants[0]["reason"]
    assert all(s["sigma"] is None and s["risk"] is None for s in r.steps)


def test_packed_weights_of_a_gguf_against_an_independent_load(tmp_path, tiny_tok):
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tok))
    lm = lmtrace.load(path, device="cpu", dtype="float32")
    r = lmtrace.stability(lm, PROMPT, ["weights:packed"], temperature=0, max_new_tokens=8)
    v = r.variants[0]
    assert v["status"] == "ran" and "packed" in v["about"], v["reason"]
    ids, tokens = r.reference.prompt["token_ids"], r.reference.token_ids
    other = lmtrace.load(path, weights="packed").model
    lp = along(plain(other, ids + tokens, len(ids)), tokens)
    base = along(plain(lm.model, ids + tokens, len(ids)), tokens)
    for s, x, b in zip(v["steps"], lp, base):
        assert abs(s["logprob"] - x) <= TOL and abs(s["delta"] - (x - b)) <= TOL
    # lmtrace's kernel: the file's own Q8_0 weights (8-bit codes, c * d exactly) in float32 chains of
    # multiply-adds: within the opt-in bound of the float path (on this 64-wide model, often its bits)
    assert "lmtrace's kernel" in v["about"] and v["max_abs_delta"] <= 5e-5
    assert v["first_divergence"] == first_divergence(tokens, hf_tokens(other, [ids], lm, 8))


def test_compile_against_a_plain_forward_and_generate(tiny_lm):
    """The compile variant (a compiled forward for forcing, generate(compile=True) for decoding)
    on the session's tiny model, whose compiled decode step other tests may have built already."""
    r = lmtrace.stability(tiny_lm, "Hello world", ["compile"], temperature=0, max_new_tokens=4, stop_on_eos=False)
    v = r.variants[0]
    assert v["status"] == "ran", v["reason"]
    ids, tokens = r.reference.prompt["token_ids"], r.reference.token_ids
    lp = along(plain(tiny_lm.model, ids + tokens, len(ids)), tokens)
    assert all(abs(s["logprob"] - x) <= TOL and abs(s["delta"]) <= TOL for s, x in zip(v["steps"], lp))
    assert v["first_divergence"] == first_divergence(tokens, hf_tokens(tiny_lm.model, [ids], tiny_lm, 4)) is None


def test_a_seeded_sample_keeps_its_draws_under_the_same_seed(lm):
    r = lmtrace.stability(lm, PROMPT, ["threads:2", "batch:2"], temperature=0.9, top_k=20, seed=11, max_new_tokens=8)
    assert r.reference.params["seed"] == 11
    for v in r.variants:  # float rounding only: the same seed draws the same tokens
        assert v["first_divergence"] is None and v["token_ids"] == r.reference.token_ids


@pytest.mark.parametrize("spec,words", [
    ("fp8", ["unknown kind", "fp8"]), ("dtype:int8", ["dtype:int8", "int8"]), ("batch:1", ["batch:1", ">= 2"]),
    ("threads:x", ["threads:x", "whole number"]), ("compile:yes", ["compile:yes", "no value"]),
    ("engine:sglang", ["engine:sglang", "vllm"]), ("model:/no/such/place", ["model:/no/such/place", "no file"]),
    ("attention", ["attention", "needs a value"]),
])  # fmt: skip
def test_bad_specs_are_one_line_naming_the_variant(spec, words):
    with pytest.raises(lmtrace.InvalidParameter) as e:
        variant_spec.parse_variants([spec])
    assert str(e.value).startswith("variant:") and all(w in str(e.value) for w in words)
    with pytest.raises(lmtrace.InvalidParameter, match="given twice"):
        variant_spec.parse_variants(["dtype:bf16", "dtype:bfloat16"])


def test_noise_rules_on_handmade_numbers():
    # levels: sqrt((0.1² + 0.3²) / 2) = 0.2236 and sqrt((0.2² + 0.05²) / 2) = 0.1458
    assert noise.sigma([[0.1, None, -0.3], [-0.2, None, 0.05]]) == pytest.approx([0.2236068, None, 0.3])
    rows = noise.ledger([0.0, 0.5, 0.5, 0.5], [None, None, 0.2, 0.3], 2.0)
    assert [r["flagged"] for r in rows] == [True, False, False, True]  # a tie; no noise; 0.5 >= 0.4; 0.5 < 0.6
    assert rows[1]["risk"] is None and rows[2]["risk"] == pytest.approx(2.5)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
