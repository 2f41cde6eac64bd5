"""lmtrace.rollouts on the bundled SmolLM2-135M: the raw and processed numbers equal
transformers' own teacher-forced log-softmax and warpers within 5e-5 (batched, float32, GRPO
groups sharing their prompt), the split adds up within 1e-6, a clean rollout has no cause, and
a bfloat16 engine is named."""

from __future__ import annotations

import pytest

import lmtrace
from tests import rollout_world as world
from tests.test_rollouts import oracle

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SAMPLING = {"temperature": 0.7, "top_p": 0.9}


def test_bundled_numbers_equal_transformers(bundled_lm):
    ids = world.prompt_ids(bundled_lm)[:2]
    records = []
    for seed in range(3):
        records += world.decode(bundled_lm, ids, n=12, seed=seed, **SAMPLING)
    records = [{**r, "id": str(i)} for i, r in enumerate(records)]
    rep = lmtrace.rollouts(bundled_lm, records)
    worst = 0.0
    for rec, out in zip(records, rep["rollouts"]):
        raw, processed = oracle(bundled_lm.model, rec["prompt_ids"], rec["completion_ids"], SAMPLING)
        for t, a, p, e in zip(out["tokens"], raw, processed, rec["logprobs"]):
            worst = max(worst, abs(t["raw_logprob"] - a), abs(t["processed_logprob"] - p))
            assert abs(t["processing"] + t["residual"] - (e - t["raw_logprob"])) <= 1e-6
        assert out["causes"] == []
    assert worst < 5e-5, worst
    assert rep["summary"]["outside_0_9_1_1"] == 0.0 and rep["summary"]["causes"] == []


def test_bundled_bfloat16_engine_is_numeric(bundled_lm):
    rep = lmtrace.rollouts(bundled_lm, world.bfloat16(bundled_lm)[:2])
    assert [[(c["cause"], c["detail"]) for c in r["causes"]] for r in rep["rollouts"]] == \
        [[("numeric", "dtype:bfloat16")]] * 2  # fmt: skip
