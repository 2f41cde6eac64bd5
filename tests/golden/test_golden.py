"""The goldens recorded before the families moved into folders (issue 22) still hold: the same
CLI commands and /v1/traces request give the same token ids and texts, numbers within 1e-6."""

from __future__ import annotations

import pytest

from tests.golden.cases import CLI_CASES, differences, load, normalize
from tests.golden.record import run_cli, traces_answer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_json_equals_the_golden(name, bundled_lm):
    found = differences(load(name), normalize(run_cli(CLI_CASES[name])))
    assert not found, "\n".join(found[:20])


def test_v1_traces_equals_the_golden(bundled_lm):
    found = differences(load("v1_traces"), normalize(traces_answer(bundled_lm)))
    assert not found, "\n".join(found[:20])


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
