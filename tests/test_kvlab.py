"""The KV-cache lab on the tiny model: the full arm equals the reference bit for bit, step 0 is
the same for every policy, each policy keeps exactly what its rule says (checked against
independent computations: an uncached forward with an explicit mask over the kept positions,
eager attention weights, key norms), and bytes measured on the tensors equal the formula."""

from __future__ import annotations

import pytest
import torch

from lmtrace.errors import InvalidParameter
from lmtrace.kvlab import kvlab, parse_policy
from lmtrace.kvlab.capture import Recorder, capturing

PROMPT = "Hello world, the quick brown fox"
ALL = ["full", "window:size=4", "streaming:sinks=2,window=4", "h2o:budget=0.5", "snapkv:budget=0.5,window=2",
       "tova:budget=6", "knorm:budget=6", "fp8"]  # fmt: skip


@pytest.fixture(scope="module")
def lab(tiny_lm):
    return kvlab(tiny_lm, PROMPT, ALL, max_new_tokens=8, temperature=0, map_step=0)


def test_full_arm_equals_the_reference_bit_for_bit(lab):
    full = lab.arm("full")
    assert [s["logprob"] for s in full["steps"]] == [s.logprob for s in lab.reference.steps]
    assert all(s["kl"] == 0 and s["delta"] == 0 and s["top1_agree"] for s in full["steps"])
    assert full["summary"]["divergence_step"] is None and full["summary"]["bytes_fraction"] == 1.0
    assert [s["bytes"] for s in full["steps"]] == [s.kv["bytes"] for s in lab.reference.steps]


def test_step_zero_is_the_same_for_every_policy(lab):
    for arm in lab.arms:
        first = arm["steps"][0]
        assert first["delta"] == 0 and first["kl"] == 0, arm["policy"]
        assert first["logprob"] == lab.reference.steps[0].logprob


def test_measured_bytes_equal_the_formula_at_every_step(lab):
    for arm in lab.arms:
        assert all(s["bytes"] == s["bytes_formula"] for s in arm["steps"]), arm["policy"]


def test_fp8_bytes_are_the_quantized_storage(lab, tiny_lm):
    cfg = tiny_lm.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    fp8 = lab.arm("fp8")
    for step, ref_bytes in zip(fp8["steps"], lab.reference_bytes):
        slots = lab.prompt_tokens + step["index"]
        per_layer = 2 * cfg.num_key_value_heads * head_dim * slots * 1 + 2 * 4  # e4m3 bytes + two float32 scales
        assert step["bytes"] == cfg.num_hidden_layers * per_layer
        assert step["bytes"] < ref_bytes / 3


def _positions(arm, layer=0):
    return arm["kept_map"][layer]


def test_window_and_streaming_keep_their_positions(lab):
    p = lab.prompt_tokens  # map_step 0: after the prefill's eviction
    assert _positions(lab.arm("window")) == list(range(p - 4, p))
    assert _positions(lab.arm("streaming")) == [0, 1, *range(p - 4, p)]
    for arm in ("window", "streaming"):
        counts = [s["kept"] for s in lab.arm(arm)["steps"]]
        assert all(c == [4 if arm == "window" else 6] * 2 for c in counts)


def _masked_oracle(lm, ids, visible) -> torch.Tensor:
    """Uncached forward over `ids` where row q sees exactly `visible(q)`: (len, vocab) logprobs."""
    n = len(ids)
    mask = torch.zeros((1, 1, n, n), dtype=torch.bool)
    for q in range(n):
        mask[0, 0, q, list(visible(q))] = True
    with torch.no_grad():
        out = lm.model(input_ids=torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(n)[None])
    return torch.log_softmax(out.logits[0].float(), dim=-1)


@pytest.mark.parametrize("spec,rule", [
    ("window:size=4", lambda q, p: range(max(0, q - 4), q + 1)),
    ("streaming:sinks=2,window=3", lambda q, p: sorted({0, 1, *range(max(0, q - 3), q + 1)})),
])  # fmt: skip
def test_evicting_arm_equals_an_uncached_forward_over_the_kept_positions(tiny_lm, spec, rule):
    result = kvlab(tiny_lm, PROMPT, [spec], max_new_tokens=10, temperature=0)
    ids = result.reference.prompt["token_ids"] + result.reference.token_ids
    p = len(result.reference.prompt["token_ids"])
    oracle = _masked_oracle(tiny_lm, ids, lambda q: range(q + 1) if q < p else rule(q, p))
    arm = result.arms[0]
    for step in arm["steps"]:
        i = step["index"]
        expected = float(oracle[p + i - 1, result.reference.token_ids[i]])
        assert step["logprob"] == pytest.approx(expected, abs=1e-5)
    assert max(s["kl"] for s in arm["steps"]) > 1e-3  # the eviction really changed something


def _eager_prompt_attention(lm, ids):
    """Per layer (heads mean) attention of an uncached eager forward: (len, len)."""
    model = lm.model
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        model.config._attn_implementation = before
    return [a[0].mean(0) for a in out.attentions]


def _top(scores: torch.Tensor, k: int, protected: set[int]) -> list[int]:
    rest = [i for i in torch.argsort(-scores, stable=True).tolist() if i not in protected][:k]
    return sorted(protected | set(rest))


def test_snapkv_tova_knorm_h2o_keep_what_the_attention_says(tiny_lm, lab):
    ids = lab.reference.prompt["token_ids"]
    p = len(ids)
    attn = _eager_prompt_attention(tiny_lm, ids)
    for layer, a in enumerate(attn):
        window_votes = a[-2:].sum(0)  # snapkv: the last 2 queries
        k = -(-p // 2)  # ceil(0.5 * p)
        assert _positions(lab.arm("snapkv"), layer) == _top(window_votes, k - 2, {p - 2, p - 1})
        assert _positions(lab.arm("tova"), layer) == _top(a[-1], 5, {p - 1})
        h2o_recent = round(k * 0.5)
        assert _positions(lab.arm("h2o"), layer) == _top(a.sum(0), k - h2o_recent, set(range(p - h2o_recent, p)))
    cache = tiny_lm.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    for layer in range(len(attn)):
        norms = cache.layers[layer].keys[0].norm(dim=-1).mean(0)
        assert _positions(lab.arm("knorm"), layer) == _top(-norms, 5, {p - 1})


def test_capture_changes_no_logit(tiny_lm):
    ids = torch.tensor([tiny_lm.tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        plain = tiny_lm.model(input_ids=ids).logits
        rec = Recorder(total=True)
        with capturing(tiny_lm.model, rec):
            captured = tiny_lm.model(input_ids=ids).logits
    assert torch.equal(plain, captured)
    assert torch.allclose(rec.total[0].sum(), torch.tensor(float(ids.shape[1])), atol=1e-4)  # rows sum to 1
    assert tiny_lm.model.config._attn_implementation == "sdpa"


def test_divergence_and_free_generation(tiny_lm):
    result = kvlab(tiny_lm, PROMPT, ["window:size=2"], max_new_tokens=8, temperature=0, free=True)
    arm = result.arms[0]
    div = arm["summary"]["divergence_step"]
    assert div is not None
    assert all(s["top1_agree"] for s in arm["steps"][:div])
    free = arm["free"]
    assert free["divergence_step"] == div and free["token_ids"][0] != result.reference.token_ids[div]
    assert len(free["token_ids"]) <= len(result.reference.token_ids) - div


def test_teacher_forced_continuation(tiny_lm):
    text = " the lazy dog jumps over the quick brown fox."
    result = kvlab(tiny_lm, "Once", ["full", "window:size=4"], continuation=text, top_logprobs=3)
    assert result.teacher_forced and "".join(s.text for s in result.reference.steps) == text
    full = result.arm("full")
    assert [s["logprob"] for s in full["steps"]] == [s.logprob for s in result.reference.steps]
    d = result.to_dict()
    assert set(d) >= {"reference", "arms"}
    assert set(d["arms"][0]["steps"][0]) >= {"index", "logprob", "delta", "kl", "top1_agree", "rank", "kept", "bytes"}
    assert set(d["arms"][0]["summary"]) >= {"bytes_fraction", "mean_kl", "max_kl", "top1_agreement", "perplexity",
                                            "divergence_step"}  # fmt: skip


@pytest.mark.parametrize("spec,words", [
    ("window:size=0", ["window", "size"]),
    ("window:sise=3", ["window", "sise"]),
    ("streaming:sinks=x", ["streaming", "sinks"]),
    ("h2o:budget=1.5", ["h2o", "budget"]),
    ("h2o:recent=2", ["h2o", "recent"]),
    ("snapkv:window", ["snapkv", "window"]),
    ("int4:backend=gptq", ["int4", "backend"]),
    ("lru", ["lru"]),
])  # fmt: skip
def test_bad_specs_name_the_policy_and_the_parameter(spec, words):
    with pytest.raises(InvalidParameter) as e:
        parse_policy(spec)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words)


def test_spec_round_trip():
    assert parse_policy("streaming:window=8").spec == "streaming:sinks=4,window=8"
    assert parse_policy("h2o:budget=64").spec == "h2o:budget=64,recent=0.5"


def test_rerotated_keys_equal_the_keys_computed_at_their_slots(tiny_lm):
    """Layer 0's keys depend only on the token and the position: after the prefill's eviction,
    the kept keys re-rotated onto slots 0..3 equal a fresh forward of those tokens at 0..3."""
    from lmtrace.kvlab import runner
    from lmtrace.params import SamplingParams

    ids = tiny_lm.tokenizer(PROMPT)["input_ids"]
    arm = runner.new_arm(tiny_lm.model, parse_policy("window:size=4,rerotate=1"), SamplingParams(temperature=0))
    with torch.no_grad():
        runner.forward(tiny_lm.model, arm, ids, 0)
        fresh = tiny_lm.model(input_ids=torch.tensor([ids[-4:]]), position_ids=torch.arange(4)[None]).past_key_values
    assert arm.lab.positions[0].tolist() == list(range(len(ids) - 4, len(ids)))
    assert torch.allclose(arm.lab.cache.layers[0].keys, fresh.layers[0].keys, atol=1e-5)
    assert arm.lab.next_position(len(ids)) == 4


def test_rerotate_without_eviction_changes_nothing(tiny_lm):
    result = kvlab(tiny_lm, PROMPT, ["streaming:sinks=4,window=64,rerotate=1"], max_new_tokens=6, temperature=0)
    assert [s["logprob"] for s in result.arms[0]["steps"]] == [s.logprob for s in result.reference.steps]
    assert result.arms[0]["policy"] == "streaming:sinks=4,window=64,rerotate=1"


def test_sampled_reference_full_arm_never_diverges(tiny_lm):
    result = kvlab(tiny_lm, PROMPT, ["full", "window:size=2"], max_new_tokens=8, temperature=1.0, seed=3)
    assert result.reference.params["seed"] == 3
    assert result.arm("full")["summary"]["divergence_step"] is None
    assert result.arm("full")["summary"]["mean_kl"] == 0
