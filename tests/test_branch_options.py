"""lmtrace.branch with generate's options: the original is generate's trace, every branch
records what it records, and the step at the branch point (whose forward is not run again) gets
the captures of the forward behind it restored."""

from __future__ import annotations

import torch

import lmtrace
from tests.composability import comparable

PROMPT = "Once upon a time"
KW = {"max_new_tokens": 8, "temperature": 0, "top_logprobs": 3, "stop_on_eos": False}


def test_the_original_is_generates_trace_and_the_branches_record_as_it_does(tiny_lm):
    kw = {**KW, "echo": True, "waterfall": "all", "lens": True, "uncertainty": True, "attribution": True}
    result = lmtrace.branch(tiny_lm, PROMPT, 3, [2, 3], **kw)
    original, *branches = result.traces
    assert comparable(original.to_dict()) == comparable(lmtrace.generate(tiny_lm, PROMPT, **kw).to_dict())
    plain = lmtrace.branch(tiny_lm, PROMPT, 3, [2, 3], **KW).traces[1:]
    for b, p in zip(branches, plain):
        assert b.token_ids == p.token_ids  # the numbers within float noise: echo's prefill keeps every position
        assert max(abs(s.logprob - t.logprob) for s, t in zip(b.steps, p.steps)) < 1e-5
        assert b.prompt_logprobs == original.prompt_logprobs and b.entries["uncertainty"] is not None
        assert all(s.waterfall and s.lens and s.entries["attribution"] and s.entries["uncertainty"] for s in b.steps)


def test_the_branch_step_attributes_the_forward_behind_it(tiny_lm):
    """At the branch point the attribution splits the forced token's logit difference, from the
    forward behind that step (restored), not the original's last forward."""
    at = 3
    result = lmtrace.branch(tiny_lm, PROMPT, at, [2], attribution=True, **KW)
    original, branch = result.traces
    a = branch.steps[at].entries["attribution"]
    assert a["token_id"] == branch.token_ids[at] != original.token_ids[at]
    ids = original.prompt["token_ids"] + original.token_ids[:at]
    with torch.no_grad():
        logits = tiny_lm.model(torch.tensor([ids])).logits[0, -1].float()
    expected = float(logits[a["token_id"]] - logits[a["against_token_id"]])
    assert abs(a["logit_diff"] - expected) < 1e-4
    assert abs(sum(p["value"] for p in a["parts"]) - a["logit_diff"]) < 1e-3


def test_processors_see_each_branchs_own_tokens(tiny_lm):
    seen: list[list[int]] = []

    def spy(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(token_ids))
        return logits

    result = lmtrace.branch(tiny_lm, PROMPT, 2, [2], logits_processors=[spy], **KW)
    original, branch = result.traces
    assert original.token_ids[:2] + [branch.token_ids[2]] == branch.token_ids[:3]
    assert branch.token_ids[:4] in seen  # the branch's processors were handed its own history
    assert branch.params["logits_processors"] == ["spy"]
