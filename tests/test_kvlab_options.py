"""kv-lab with generate's options: the reference is generate's own trace, and every arm's own
choice follows the reference's rule (its grammar, its processors): the `full` arm, whose logits
are the reference's bit for bit, never leaves it, as it would if it chose without them."""

from __future__ import annotations

import pytest

import lmtrace
from lmtrace.decode import constrained
from lmtrace.params import SamplingParams
from tests.composability import comparable, no_top_token

PROMPT = "Hello world, the quick brown fox"
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"


def test_the_reference_is_generates_trace_with_its_options(tiny_lm):
    kw = {"max_new_tokens": 6, "temperature": 0, "top_logprobs": 3, "lens": True, "echo": True, "waterfall": "all"}
    lab = lmtrace.kvlab(tiny_lm, PROMPT, ["full", "window:size=4"], **kw)
    assert comparable(lab.reference.to_dict()) == comparable(lmtrace.generate(tiny_lm, PROMPT, **kw).to_dict())
    assert lab.reference.steps[0].lens and lab.reference.prompt_logprobs


RULES = [{"regex": REGEX, "max_new_tokens": 10}, {"logits_processors": [no_top_token]}]


@pytest.mark.parametrize("kw", RULES, ids=["regex", "processor"])
def test_the_full_arm_follows_the_references_rule(tiny_lm, kw):
    kw = {"max_new_tokens": 6, "temperature": 0, **kw}
    lab = lmtrace.kvlab(tiny_lm, PROMPT, ["full", "window:size=3"], free=True, **kw)
    assert comparable(lab.reference.to_dict()) == comparable(lmtrace.generate(tiny_lm, PROMPT, **kw).to_dict())
    assert lab.arm("full")["summary"]["divergence_step"] is None


def test_a_free_arm_decodes_under_the_grammar(tiny_lm):
    params = SamplingParams(max_new_tokens=10, temperature=0, regex=REGEX)
    lab = lmtrace.kvlab(tiny_lm, PROMPT, ["window:size=2"], free=True, params=params)
    arm = lab.arm("window")
    div = arm["summary"]["divergence_step"]
    if div is None:
        pytest.skip("the window arm never left the reference on this model")
    (matcher,) = constrained.matchers(tiny_lm, [params])
    for token in lab.reference.token_ids[:div] + arm["free"]["token_ids"]:
        assert matcher.done or matcher.accept(token)


def test_a_continuation_refuses_what_only_a_generation_has(tiny_lm):
    with pytest.raises(lmtrace.InvalidParameter, match="^continuation and lens: "):
        lmtrace.kvlab(tiny_lm, PROMPT, ["full"], continuation=" jumps over", lens=True)
    with pytest.raises(lmtrace.InvalidParameter, match="^continuation and regex: "):
        lmtrace.kvlab(tiny_lm, PROMPT, ["full"], continuation=" jumps over", regex=REGEX)
