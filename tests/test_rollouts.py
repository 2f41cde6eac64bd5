"""lmtrace.rollouts: the per-token numbers against transformers' own log-softmax and warpers,
the split engine − raw = processing + residual, the frameworks' metrics by hand, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import lmtrace
from lmtrace.errors import InvalidParameter
from tests import rollout_world as world

SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}


def oracle(model, prompt: list[int], completion: list[int], sampling: dict) -> tuple[list[float], list[float]]:
    """(raw, processed) logprobs of the completion by transformers alone: one plain forward of
    the whole sequence, its log-softmax, and its own warpers in generate's order."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (n, vocab)
    target = torch.tensor(completion)[:, None]
    raw = torch.log_softmax(logits, -1).gather(-1, target)[:, 0]
    warped = logits
    for w in (TemperatureLogitsWarper(sampling.get("temperature", 1.0)), TopKLogitsWarper(sampling.get("top_k", 0) or
              logits.shape[-1]), TopPLogitsWarper(sampling.get("top_p", 1.0))):  # fmt: skip
        warped = w(ids, warped)
    processed = torch.log_softmax(warped, -1).gather(-1, target)[:, 0]
    return raw.tolist(), processed.tolist()


def grpo(lm, seed: int = 0) -> list[dict]:
    """Two prompts with a group of three samples each (they share their prompt: the first is long
    enough to be computed once, forward.SHARE_FROM), one alone."""
    ids = world.prompt_ids(lm)
    ids[0] = list(lm.tokenizer(" ".join(world.PROMPTS) * 3)["input_ids"])
    records = []
    for k in range(3):
        records += world.decode(lm, [ids[0], ids[1]], n=10 + k, seed=seed + k, **SAMPLING)
    records += world.decode(lm, [ids[2]], n=7, seed=seed + 9, **SAMPLING)
    return [{**r, "id": f"r{i}"} for i, r in enumerate(records)]


@pytest.fixture(scope="module")
def report(tiny_lm):
    records = grpo(tiny_lm)
    return records, lmtrace.rollouts(tiny_lm, records, caps=[1.05, 2])


def test_raw_and_processed_equal_transformers(tiny_lm, report):
    records, rep = report
    worst = 0.0
    for rec, out in zip(records, rep["rollouts"]):
        raw, processed = oracle(tiny_lm.model, rec["prompt_ids"], rec["completion_ids"], SAMPLING)
        for t, a, p in zip(out["tokens"], raw, processed):
            worst = max(worst, abs(t["raw_logprob"] - a), abs(t["processed_logprob"] - p))
    assert worst < 5e-5, worst


def test_the_split_adds_up_and_a_clean_rollout_has_no_cause(report):
    records, rep = report
    for rec, out in zip(records, rep["rollouts"]):
        assert out["causes"] == [] and len(out["tokens"]) == len(rec["completion_ids"])
        for t, e in zip(out["tokens"], rec["logprobs"]):
            assert t["engine_logprob"] == e
            assert abs(t["processing"] + t["residual"] - (e - t["raw_logprob"])) <= 1e-6
            assert abs(t["residual"]) < 1e-4 and t["trainer_logprob"] == t["processed_logprob"]
            assert t["ratio"] == pytest.approx(math.exp(t["trainer_logprob"] - e), rel=1e-12) and not t["flagged"]
    s = rep["summary"]
    assert s["outside_0_9_1_1"] == 0.0 and s["causes"] == [] and s["sequences"] == len(records)
    assert s["tokens"] == sum(len(r["completion_ids"]) for r in records)


def test_metrics_by_hand(tiny_lm):
    """Against a trainer that differs (bfloat16), so that every metric is away from zero."""
    records = grpo(tiny_lm, seed=3)
    rep = lmtrace.rollouts(tiny_lm, records, trainer="dtype:bfloat16", caps=[1.02, 1.5])
    rows = [[(t["engine_logprob"], t["trainer_logprob"]) for t in r["tokens"]] for r in rep["rollouts"]]
    d = [e - t for row in rows for e, t in row]
    s = rep["summary"]
    assert s["k1"] == pytest.approx(sum(d) / len(d), abs=1e-12)
    assert s["k2"] == pytest.approx(sum(x * x / 2 for x in d) / len(d), abs=1e-12)
    assert s["k3"] == pytest.approx(sum(math.exp(-x) + x - 1 for x in d) / len(d), abs=1e-12)
    assert s["mean_abs_delta"] == pytest.approx(sum(abs(x) for x in d) / len(d), abs=1e-12) and s["mean_abs_delta"] > 0
    seq = [sum(e - t for e, t in row) / len(row) for row in rows]
    assert s["ppl_ratio"] == pytest.approx(sum(math.exp(x) for x in seq) / len(seq), rel=1e-12)
    ratios = [math.exp(-x) for x in d]
    assert s["outside_0_9_1_1"] == sum(not 0.9 <= r <= 1.1 for r in ratios) / len(ratios)
    for cap in s["caps"]:
        c = cap["cap"]
        assert cap["tokens_clipped"] == sum(r > c for r in ratios) / len(ratios)
        assert cap["tokens_masked"] == sum(not 1 / c <= r <= c for r in ratios) / len(ratios)
        assert cap["sequences_masked"] == sum(not 1 / c <= math.exp(-x) <= c for x in seq) / len(seq)
    assert any(cap["tokens_masked"] > 0 for cap in s["caps"])
    assert rep["trainer"] == "dtype:bfloat16"


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt_ids": [1, 2], "logprobs": [-1.0]}, "line 1: completion_ids is missing"),
        ({"prompt_ids": [1, 2], "completion_ids": [3, 4], "logprobs": [-1.0]},
         "line 1: logprobs has 1 values for 2 completion ids"),
        ({"prompt_ids": [1, 2], "completion_ids": [3, 10**6], "logprobs": [-1.0, -2.0]},
         "line 1: completion_ids[1] = 1000000 is outside the model's vocabulary"),
        ({"completion_ids": [3], "logprobs": [-1.0]}, "line 1: prompt_ids is missing"),
        ({"prompt_ids": [1], "completion_ids": [3], "logprobs": [0.5]}, "line 1: logprobs[0] must be a finite logprob"),
        ({"prompt_ids": [1], "completion_ids": [3], "logprobs": [-1.0], "sampling": {"top_p": 2}},
         "line 1: sampling is not valid"),
    ],
)
def test_bad_records_name_the_line_and_the_field(tiny_lm, record, message):
    with pytest.raises(InvalidParameter, match="rollouts: " + message.replace("[", r"\[").replace("]", r"\]")):
        lmtrace.rollouts(tiny_lm, [record])


def test_bad_options(tiny_lm):
    good = [{"prompt_ids": [1], "completion_ids": [3], "logprobs": [-1.0]}]
    with pytest.raises(InvalidParameter, match="format: unknown format 'sglang'"):
        lmtrace.rollouts(tiny_lm, good, fmt="sglang")
    with pytest.raises(InvalidParameter, match="cap must be a number > 1"):
        lmtrace.rollouts(tiny_lm, good, caps=[0.5])
    with pytest.raises(InvalidParameter, match="variant: unknown kind"):
        lmtrace.rollouts(tiny_lm, good, trainer="fp8")


def test_trainer_with_a_float32_lm_head(tiny_lm):
    """--trainer lm_head:float32: the model in bfloat16, its lm_head in float32 — the trainer's
    numbers equal the bf16 model's final hidden state (transformers' own, after the norm) through
    the float32 lm_head, processed by transformers' warpers."""
    from lmtrace.scoring.variants.worlds import cast

    records = world.decode(tiny_lm, world.prompt_ids(tiny_lm)[:2], n=8, seed=4, temperature=0.7)
    bf16 = cast(tiny_lm.model, torch.bfloat16)
    head = tiny_lm.model.lm_head.weight.float()
    for rec in records:  # one at a time: one unpadded forward each, as the hand computation (bf16 rounds by shape)
        rep = lmtrace.rollouts(tiny_lm, [rec], trainer="lm_head:float32")
        out = rep["rollouts"][0]
        ids = torch.tensor([rec["prompt_ids"] + rec["completion_ids"]])
        with torch.no_grad():
            hidden = bf16(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].float()  # (seq, hidden)
        p = len(rec["prompt_ids"])
        logits = (hidden @ head.T)[p - 1 : -1] / 0.7  # (n, vocab)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(rec["completion_ids"])[:, None])[:, 0]
        got = torch.tensor([t["trainer_logprob"] for t in out["tokens"]])
        assert (got - expected).abs().max() < 1e-4
    assert rep["trainer"] == "lm_head:float32"
