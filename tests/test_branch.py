"""Branching at a step: the shared prefix, the K-th alternative, an exact greedy continuation,
and the cache of the prefix reused (forward calls counted)."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace import Branches, InvalidParameter
from tests.oracle import hf_greedy, teacher_forced
from tests.test_echo import forward_calls

PROMPT = "Once upon a time"


def raw_order(lm, ids: list[int]) -> list[int]:
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits[0, -1].float()
    return torch.argsort(logits, descending=True).tolist()


@pytest.mark.parametrize("at", [0, 3])
def test_greedy_branch_takes_the_kth_token_and_continues_as_greedy(tiny_lm, at):
    n = 12
    result = lmtrace.branch(tiny_lm, PROMPT, at, [2, 3], max_new_tokens=n, temperature=0, stop_on_eos=False)
    original, *branches = result.traces
    assert result.alternatives == [None, 2, 3] and len(branches) == 2
    assert (
        original.token_ids
        == lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=n, temperature=0, stop_on_eos=False).token_ids
    )
    ids = original.prompt["token_ids"]
    order = raw_order(tiny_lm, ids + original.token_ids[:at])
    for k, b in zip([2, 3], branches):
        assert b.token_ids[:at] == original.token_ids[:at]  # the shared prefix
        assert [s.to_dict() for s in b.steps[:at]] == [s.to_dict() for s in original.steps[:at]]
        assert b.token_ids[at] == order[k - 1] and b.steps[at].rank == k
        forced = ids + b.token_ids[: at + 1]
        hf_ids, _ = hf_greedy(tiny_lm, forced, n - at - 1)  # greedy from the forced prefix
        assert b.token_ids[at + 1 :] == hf_ids
        raw, _ = teacher_forced(tiny_lm, ids, b.token_ids, lmtrace.SamplingParams(temperature=0))
        assert max(abs(s.logprob - r) for s, r in zip(b.steps, raw)) < 1e-5
        assert b.steps[at].kv["seq_len"] == len(ids) + at
        assert b.text == tiny_lm.tokenizer.decode(b.token_ids)


def test_the_prefix_is_not_recomputed(tiny_lm):
    at, n = 5, 10
    with forward_calls(tiny_lm.model) as calls:
        result = lmtrace.branch(tiny_lm, PROMPT, at, fan=3, max_new_tokens=n, temperature=0, stop_on_eos=False)
    ids = result.traces[0].prompt["token_ids"]
    assert result.alternatives == [None, 2, 3]  # rank 1 is the greedy original itself
    # the original: one prefill, then one token per step; each branch: only its own new
    # tokens, one at a time (the forced one and those after it, the last never fed)
    expected = [len(ids)] + [1] * (n - 1) + [1] * (n - at - 1) * 2
    assert calls == expected
    assert sum(calls) == len(ids) + (n - 1) + 2 * (n - at - 1)


def test_sampled_branch_keeps_the_settings(tiny_lm):
    kw = dict(max_new_tokens=10, temperature=0.9, top_k=40, repetition_penalty=1.2, seed=11, stop_on_eos=False)
    result = lmtrace.branch(tiny_lm, PROMPT, 4, [2], **kw)
    original, b = result.traces
    assert original.token_ids == lmtrace.generate(tiny_lm, PROMPT, **kw).token_ids
    assert b.params == original.params and b.token_ids[:4] == original.token_ids[:4]
    params = lmtrace.SamplingParams(**kw)
    raw, used = teacher_forced(tiny_lm, original.prompt["token_ids"], b.token_ids, params)
    assert max(abs(s.logprob - r) for s, r in zip(b.steps, raw)) < 1e-5
    assert max(abs(s.sampled_logprob - u) for s, u in zip(b.steps[5:], used[5:])) < 1e-5
    again = lmtrace.branch(tiny_lm, PROMPT, 4, [2], **kw)  # the same seed gives the same branch
    assert again.traces[1].token_ids == b.token_ids


def test_json_shape_and_round_trip(tiny_lm):
    result = lmtrace.branch(tiny_lm, "Hello", 1, [2], max_new_tokens=4, temperature=0)
    d = result.to_dict()
    assert set(d) == {"at", "alternatives", "branches"} and len(d["branches"]) == 2
    assert [b["label"] for b in d["branches"]] == ["original", "alternative 2 at step 1"]
    assert Branches.from_dict(d) == result


BAD = [
    (dict(at=4), "at must be in [0, 3], got 4"),
    (dict(at=-1), "at must be in [0, 3], got -1"),
    (dict(at=1, alternatives=[0]), "alternative must be in [1, 300], got 0"),
    (dict(at=1, fan=0), "fan must be in [1, 300], got 0"),
    (dict(at=1, alternatives=[2], fan=2), "alternative: give alternative ranks or fan, not both"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_input(tiny_lm, kwargs, message):
    with pytest.raises(InvalidParameter) as e:
        lmtrace.branch(tiny_lm, "Hello", max_new_tokens=4, temperature=0, **kwargs)
    assert str(e.value) == message


def test_a_step_the_decoding_never_reached(tiny_lm):
    first = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=1, temperature=0).steps[0].text
    assert first  # a stop string the greedy decoding completes at step 0
    with pytest.raises(InvalidParameter, match=r"at must be a step the decoding reached \(0\.\.0\), got 2"):
        lmtrace.branch(tiny_lm, "Hello world", 2, max_new_tokens=5, temperature=0, stop=(first,))
