"""lmtrace.branch with generate's options: the original is generate's trace, every branch
records what it records, and the step at the branch point (whose forward is not run again) gets
the captures of the forward behind it restored."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.decode import tracing
from tests.composability import comparable, differences, no_top_token

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


# --- a drafted branch (decode/branch_draft.py) takes every option: each trace is the plain branch's ---

DRAFTED_OPTIONS = {
    "lens+attention": {"lens": True, "attention": True},
    "echo+waterfall+uncertainty": {"echo": True, "waterfall": "all", "uncertainty": True},
    "processor+penalty": {"logits_processors": [no_top_token], "repetition_penalty": 1.3},
    "regex": {"regex": r"[a-c]{2,4}-[0-9]{1,3}", "max_new_tokens": 10, "stop_on_eos": True},
    "choice": {"choice": ("the quick", "the lazy dog", "world"), "stop_on_eos": True},
}
# where the drafted and the plain branch fork: (at, ranks, fan); the choice allows one token at step 2
FORKS = {"choice": (0, None, 3)}


@pytest.mark.parametrize("name", DRAFTED_OPTIONS)
def test_a_drafted_branch_is_the_plain_branch_with_every_option(tiny_lm, name):
    """Greedy, the original and every branch decoded with a draft are the plain branches: the same
    token ids, every number within the speculative bound (the verify forward runs K + 1 positions),
    every option's record (the observers back at the fork, the penalty, the processors' history and
    the grammar at the branch's own tokens, the alternatives ranked among the allowed tokens)."""
    kw = {**KW, **DRAFTED_OPTIONS[name]}
    at, ranks, fan = FORKS.get(name, (2, [2, 3], None))
    drafted = lmtrace.branch(tiny_lm, PROMPT, at, ranks, fan=fan, draft="layers:1", draft_tokens=2, **kw)
    plain = lmtrace.branch(tiny_lm, PROMPT, at, ranks, fan=fan, **kw)
    assert drafted.alternatives == plain.alternatives and len(drafted.traces) > 1
    for d, p in zip(drafted.traces, plain.traces, strict=True):
        assert d.token_ids == p.token_ids
        assert not differences(comparable(d.to_dict()), comparable(p.to_dict()), 1e-4)
        assert d.speculative["blocks"] >= 1
    assert any(s.draft is not None for t in drafted.traces[1:] for s in t.steps[at + 1 :])
    original, *branches = drafted.traces
    assert any(b.token_ids[at] != original.token_ids[at] for b in branches)


def test_a_drafted_branch_goes_on_as_generate_from_its_tokens(tiny_lm):
    """After the fork a drafted branch decodes as generate does from the prompt and the branch's
    tokens up to there (the attention's absolute positions and the lens too)."""
    kw = {**KW, "lens": True, "attention": True, "uncertainty": True}
    at = 2
    branch = lmtrace.branch(tiny_lm, PROMPT, at, [2], draft="layers:1", draft_tokens=3, **kw).traces[1]
    ids = branch.prompt["token_ids"] + branch.token_ids[: at + 1]
    rest_kw = {**kw, "max_new_tokens": KW["max_new_tokens"] - at - 1, "draft": "layers:1", "draft_tokens": 3}
    (rest,) = tracing.generate_ids(tiny_lm, [ids], **rest_kw)
    assert branch.token_ids[at + 1 :] == rest.token_ids
    ours = [comparable(s.to_dict()) for s in branch.steps[at + 1 :]]
    theirs = [comparable(s.to_dict()) for s in rest.steps]
    for s in ours + theirs:  # the step's number and its place in the sequence differ by construction
        s.pop("index", None)
        s.pop("kv", None)
    assert not differences(ours, theirs, 1e-4)


def test_a_drafted_sampled_branch_forks_from_the_originals_distribution(tiny_lm):
    """Sampled with a seed: each branch forces the K-th raw token of the distribution the original
    had at `at`, measured there as the original measured it (its alternatives, its processed
    logprob), and the same call gives the same draws again."""
    kw = {**KW, "temperature": 0.9, "seed": 3, "top_p": 0.95, "waterfall": "all"}
    at = 2
    first = lmtrace.branch(tiny_lm, PROMPT, at, [2, 3], draft="layers:1", **kw)
    again = lmtrace.branch(tiny_lm, PROMPT, at, [2, 3], draft="layers:1", **kw)
    assert [t.token_ids for t in first.traces] == [t.token_ids for t in again.traces]
    original, *branches = first.traces
    fork = original.steps[at]
    for k, branch in zip([2, 3], branches):
        step, alternative = branch.steps[at], fork.top[k - 1]
        assert branch.token_ids[:at] == original.token_ids[:at] and step.token_id == alternative.token_id
        assert step.rank == k and step.logprob == alternative.logprob
        assert step.sampled_logprob == alternative.sampled_logprob and step.top == fork.top
    assert all(s.waterfall for t in first.traces for s in t.steps)
