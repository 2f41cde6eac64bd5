"""The KV-cache lab on the bundled SmolLM2-135M-Instruct (integration): the full arm equals the
generated reference bit for bit, step 0 is the same for every policy, bytes equal the formula."""

from __future__ import annotations

import pytest

from lmtrace.kvlab import kvlab

pytestmark = pytest.mark.integration


def test_kvlab_on_the_bundled_model(bundled_lm):
    prompt = "The quick brown fox jumps over the lazy dog. Then the dog wakes up and chases the fox"
    specs = ["full", "streaming:sinks=4,window=8", "h2o:budget=0.25", "fp8"]
    result = kvlab(bundled_lm, prompt, specs, max_new_tokens=6, temperature=0)
    assert [s["logprob"] for s in result.arm("full")["steps"]] == [s.logprob for s in result.reference.steps]
    for arm in result.arms:
        assert arm["steps"][0]["delta"] == 0 and arm["steps"][0]["kl"] == 0, arm["policy"]
        assert all(s["bytes"] == s["bytes_formula"] for s in arm["steps"]), arm["policy"]
    streaming = result.arm("streaming")
    assert all(k == [12] * 30 for k in (s["kept"] for s in streaming["steps"]))
    assert streaming["kept_map"][0] == [0, 1, 2, 3, *range(result.prompt_tokens + 5 - 8, result.prompt_tokens + 5)]
    assert result.arm("fp8")["summary"]["bytes_fraction"] == pytest.approx(0.25, abs=0.01)
