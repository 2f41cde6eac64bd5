"""A re-encoded completion on the bundled SmolLM2-135M: the engine wrote 'bel'+'iev' and
' anti'+'dis' where the text's own split is 'belie'+'v' and ' ant'+'idis'; the pipeline decoded
and encoded the completion again, keeping the engine's logprobs. `lmtrace rollouts` labels it
`retokenized` at those positions and nothing else; the engine's own ids are clean."""

from __future__ import annotations

import pytest

import lmtrace
from tests import rollout_world as world

pytestmark = pytest.mark.integration
TEXT = " Unbelievably, antidisestablishmentarianism is a word."


def test_bundled_reencoded_completion_is_retokenized(bundled_lm):
    faulty, normal = world.completion_reencoded(bundled_lm, TEXT)
    faulty, normal = faulty[:2], normal[:2]
    rep = lmtrace.rollouts(bundled_lm, faulty)
    changed = [k for k, (a, b) in enumerate(zip(faulty[0]["completion_ids"], normal[0]["completion_ids"])) if a != b]
    assert len(changed) >= 4
    detail = "completion: positions " + ", ".join(map(str, changed))
    for r in rep["rollouts"]:
        assert [(c["cause"], c["detail"]) for c in r["causes"]] == [("retokenized", detail)]
        ev = r["causes"][0]["evidence"]
        assert ev["positions"] == changed and ev["retokenized_fit"] < 1e-4 and ev["aligned_fit"] > 0.1
    assert rep["summary"]["causes"] == [{"cause": "retokenized", "sequences": 2}]
    rep = lmtrace.rollouts(bundled_lm, normal)
    assert [r["causes"] for r in rep["rollouts"]] == [[], []] and rep["summary"]["mean_abs_delta"] < 1e-4
