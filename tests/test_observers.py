"""Observers (decode/observers.py): a user's own beside the built-in ones (echo, waterfall, lens and
attention), each writing its own entry in the same step; the entry equal to a hand computation from
transformers' logits; names that would overwrite a record field or a built-in entry refused."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace import InvalidParameter
from lmtrace.decode.observers import BUILT_IN
from tests.oracle import hf_greedy


class Margin(lmtrace.Observer):
    name = "margin"

    def observe(self, step, logits, tokens, how):
        top2 = logits.float().log_softmax(-1).topk(2).values  # (batch, 2)
        return (top2[:, 0] - top2[:, 1]).tolist()

    def summarize(self, steps):
        return {"smallest": min(s.margin for s in steps)}


def test_own_observer_beside_every_built_in(tiny_lm):
    prompt = "Hello world"
    ids = lmtrace.encode_prompt(tiny_lm, prompt)
    trace = lmtrace.generate(tiny_lm, prompt, max_new_tokens=6, temperature=0, observers=[Margin()], echo=True,
                             waterfall="all", lens=True, attention=True)  # fmt: skip
    hf_ids, hf_logits = hf_greedy(tiny_lm, ids, 6)
    assert trace.token_ids == hf_ids
    for i, step in enumerate(trace.steps):
        top2 = torch.log_softmax(hf_logits[i].float(), -1).topk(2).values
        assert abs(step.margin - (top2[0] - top2[1]).item()) < 1e-5
        assert step.lens is not None and step.attention is not None and step.waterfall
        assert set(step.entries) == {"margin"}  # the built-in entries are the step's own fields
        assert not set(step.to_dict()) & set(BUILT_IN) - {"waterfall"}
    assert trace.margin == {"smallest": min(s.margin for s in trace.steps)}
    assert trace.prompt_logprobs is not None and len(trace.prompt_logprobs) == len(ids)


def test_own_observer_in_a_batch_equals_each_row_alone(tiny_lm):
    prompts = ["Hello world", "很久很久以前，", "a"]
    batch = lmtrace.generate(tiny_lm, prompts, max_new_tokens=5, temperature=0, observers=[Margin()])
    for prompt, got in zip(prompts, batch):
        alone = lmtrace.generate(tiny_lm, prompt, max_new_tokens=5, temperature=0, observers=[Margin()])
        assert got.token_ids == alone.token_ids
        assert max(abs(a.margin - b.margin) for a, b in zip(got.steps, alone.steps)) < 5e-5


@pytest.mark.parametrize("name", ["", "logprob", "lens", "waterfall", "inside", "prompt"])
def test_a_name_taken_is_refused(tiny_lm, name):
    class Taken(Margin):
        pass

    Taken.name = name
    with pytest.raises(InvalidParameter, match=f"observers: name must be set, new and unique, got {name!r}"):
        lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, temperature=0, observers=[Taken()])


def test_two_of_one_name_and_a_non_observer_refused(tiny_lm):
    with pytest.raises(InvalidParameter, match="new and unique, got 'margin'"):
        lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, observers=[Margin(), Margin()])
    with pytest.raises(InvalidParameter, match="each must be an lmtrace.Observer, got function"):
        lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, observers=[lambda *a: None])


def test_rows_with_instances_of_one_observer_each_keep_their_own(tiny_lm):
    """Two rows of a continuous batch, each with its own Uncertainty instance (two requests asking
    for it): each row's entries equal its decoding alone (the second instance's entries once took
    the first row's place)."""
    from lmtrace.decode.continuous import RowSpec, generate_rows
    from lmtrace.decode.uncertainty import Uncertainty
    from lmtrace.params import SamplingParams

    prompts = ["Hello world", "很久很久以前，"]
    p = SamplingParams(max_new_tokens=5, temperature=0)
    vocab = tiny_lm.model.config.vocab_size
    specs = [RowSpec(lmtrace.encode_prompt(tiny_lm, t), p, t, observers=[Uncertainty(vocab=vocab)]) for t in prompts]
    for text, trace in zip(prompts, generate_rows(tiny_lm, specs)):
        alone = lmtrace.generate(tiny_lm, text, max_new_tokens=5, temperature=0, uncertainty=True)
        assert trace.token_ids == alone.token_ids
        for got, want in zip(trace.steps, alone.steps):
            assert got.uncertainty is not None
            assert abs(got.uncertainty["margin"] - want.uncertainty["margin"]) < 5e-5
        assert trace.uncertainty is not None
