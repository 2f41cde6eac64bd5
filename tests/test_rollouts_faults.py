"""The planted-fault suite: rollouts decoded by lmtrace itself (seeded sampling, its logprobs
as the engine's), each fault planted alone; each gets its own label, and nothing else."""

from __future__ import annotations

import pytest

import lmtrace
from tests import rollout_world as world


def labels(rep) -> list[list[tuple[str, str | None]]]:
    return [[(c["cause"], c["detail"]) for c in r["causes"]] for r in rep["rollouts"]]


def only(rep, cause: str, details: set) -> None:
    for got in labels(rep):
        assert len(got) == 1 and got[0][0] == cause and got[0][1] in details, labels(rep)
    assert rep["summary"]["causes"] == [{"cause": cause, "sequences": len(rep["rollouts"])}]


def test_clean_float32_rollouts_get_no_label(tiny_lm):
    for sampling in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.0}):
        rep = lmtrace.rollouts(tiny_lm, world.clean(tiny_lm, seed=11, **sampling))
        assert labels(rep) == [[], [], []] and rep["summary"]["outside_0_9_1_1"] == 0.0
        assert rep["summary"]["mean_abs_delta"] < 1e-5


def test_ids_shifted_by_one(tiny_lm):
    rep = lmtrace.rollouts(tiny_lm, world.off_by_one(tiny_lm))
    only(rep, "off_by_one", {"logprob i is the id at i + 1"})
    for r in rep["rollouts"]:
        ev = r["causes"][0]["evidence"]
        assert ev["shifted_fit"] < 1e-4 < 0.1 < ev["aligned_fit"]


def test_history_retokenized_and_a_sampled_split_is_no_fault(tiny_lm):
    faulty, normal = world.retokenized(tiny_lm)
    rep = lmtrace.rollouts(tiny_lm, faulty)
    only(rep, "retokenized", {"prompt"})
    for r in rep["rollouts"]:
        ev = r["causes"][0]["evidence"]
        assert ev["retokenized_fit"] < 1e-4 and ev["ids_matching"] < 1
    rep = lmtrace.rollouts(tiny_lm, normal)  # the same non-canonical ids, the engine saw them: clean
    assert labels(rep) == [[], [], []] and rep["summary"]["outside_0_9_1_1"] == 0.0


def test_temperature_sampled_but_raw_reported(tiny_lm):
    rep = lmtrace.rollouts(tiny_lm, world.temperature_raw(tiny_lm))
    only(rep, "processing_mismatch", {"temperature", "raw_reported"})
    for r in rep["rollouts"]:
        assert r["causes"][0]["evidence"]["fits"]["raw"] < 1e-4


def test_top_p_not_renormalised(tiny_lm):
    rep = lmtrace.rollouts(tiny_lm, world.top_p_unrenormalised(tiny_lm))
    only(rep, "processing_mismatch", {"top_p"})
    for r in rep["rollouts"]:  # the bias is -log S: the engine's logprob below the renormalised one
        assert all(t["residual"] <= 1e-5 for t in r["tokens"])


def test_bfloat16_engine(tiny_lm):
    rep = lmtrace.rollouts(tiny_lm, world.bfloat16(tiny_lm))
    only(rep, "numeric", {"dtype:bfloat16"})


def test_perturbed_weights(tiny_lm):
    rep = lmtrace.rollouts(tiny_lm, world.perturbed(tiny_lm))
    only(rep, "weights", {None})
    assert rep["summary"]["mean_abs_delta"] > 0.05


@pytest.mark.parametrize("temperature", [0.6, 1.4])
def test_temperature_applied_but_not_said(tiny_lm, temperature):
    """The reverse: the engine applied a temperature that the settings do not carry."""
    records = world.clean(tiny_lm, seed=12, temperature=temperature)
    for r in records:
        r["sampling"] = {}
    rep = lmtrace.rollouts(tiny_lm, records)
    only(rep, "processing_mismatch", {"temperature"})
    for r in rep["rollouts"]:
        assert r["causes"][0]["evidence"]["fitted_temperature"] == pytest.approx(temperature, rel=1e-2)


def test_completion_reencoded_from_its_text(tiny_lm):
    """The engine's ids ' the'+'r' decoded and encoded again as ' th'+'er' (the text's own split,
    as many ids), its logprobs kept: `retokenized` at those positions; kept as the engine wrote
    them: clean."""
    faulty, normal = world.completion_reencoded(tiny_lm, " there was a little model that counted tokens.")
    rep = lmtrace.rollouts(tiny_lm, faulty)
    only(rep, "retokenized", {"completion: positions 0, 1"})
    for r, f, n in zip(rep["rollouts"], faulty, normal):
        ev = r["causes"][0]["evidence"]
        assert ev["positions"] == [0, 1] and ev["engine_ids"] == n["completion_ids"][:2]
        assert ev["record_ids"] == f["completion_ids"][:2]
        assert ev["retokenized_fit"] < 1e-4 < 0.1 < ev["aligned_fit"]
    rep = lmtrace.rollouts(tiny_lm, normal)
    assert labels(rep) == [[], [], []] and rep["summary"]["mean_abs_delta"] < 1e-5
