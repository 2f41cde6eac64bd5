"""The goldens recorded before the families moved into folders (issue 22) still hold: the same
CLI commands and /v1/traces request give the same token ids and texts, numbers within 1e-6."""

from __future__ import annotations

import pytest

from tests.golden.cases import CLI_CASES, differences, load, normalize, recorded
from tests.golden.record import run_cli, traces_answer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_json_equals_the_golden(name, bundled_lm):
    where, tol = recorded()
    found = differences(load(name, where), normalize(run_cli(CLI_CASES[name])), tol=tol)
    assert not found, f"against {where.name} at {tol}:\n" + "\n".join(found[:20])


def test_v1_traces_equals_the_golden(bundled_lm):
    where, tol = recorded()
    found = differences(load("v1_traces", where), normalize(traces_answer(bundled_lm)), tol=tol)
    assert not found, f"against {where.name} at {tol}:\n" + "\n".join(found[:20])


def test_the_comparison_can_fail():
    golden = load("score")
    changed = normalize(golden)
    changed["tokens"][3]["logprob"] += 2e-6
    assert differences(golden, changed)


def test_only_the_named_additions_pass():
    golden = load("score")
    added = {**normalize(golden), "value_weighted": 1}
    other = {**normalize(golden), "something_new": 1}
    assert not differences(golden, added) and differences(golden, other)


def test_a_kl_is_held_to_twice_the_tolerance():
    golden = load("generate_greedy_inside")
    kl = golden["steps"][1]["lens"]["layers"][7]["kl_to_final"]
    for factor, fails in ((1.5, False), (2.5, True)):
        changed = normalize(golden)
        changed["steps"][1]["lens"]["layers"][7]["kl_to_final"] = kl + factor * 5e-5 * max(1.0, kl)
        assert bool(differences(golden, changed, tol=5e-5)) is fails
