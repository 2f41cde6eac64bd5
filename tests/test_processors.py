"""The processors as one ordered list (lmtrace.logits.processors): the fold equals the chain of
transformers' own processors, vLLM's order is a reordering of the same list, the waterfall is a
scan of it, and a user's processor `fn(token_ids, logits) -> logits` runs in every loop exactly
as transformers runs the same function as a LogitsProcessor in `model.generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

import lmtrace
from lmtrace.errors import GenerationError, InvalidParameter
from lmtrace.logits import processors
from lmtrace.params import SamplingParams
from lmtrace.vllm.params import process_like_vllm

# the stages listed whatever the settings (a logit bias only where one is given: tests/test_logit_bias.py)
LISTED = [name for name in processors.ORDER if processors.PROCESSORS[name].always]


def no_top_token(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Bans the most likely token after the first two generated tokens (changes greedy's path)."""
    if len(token_ids) >= 2:
        logits[int(logits.argmax())] = float("-inf")
    return logits


class AsTransformers:
    """The same function as transformers' LogitsProcessor (input_ids include the prompt)."""

    def __init__(self, fn, prompt_len: int):
        self.fn, self.prompt_len = fn, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = [self.fn(input_ids[r, self.prompt_len :].tolist(), scores[r].clone()) for r in range(scores.shape[0])]
        return torch.stack(rows)


def test_the_fold_is_the_documented_chain():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seen = torch.zeros(3, 50, dtype=torch.bool)
    seen[:, :5] = True
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.2)
    by_hand = processors.apply_repetition_penalty(logits, seen, 1.2)
    by_hand = processors.apply_min_p(processors.apply_top_p(processors.apply_top_k(
        processors.apply_temperature(by_hand, 0.7), 20), 0.8), 0.05)  # fmt: skip
    assert torch.equal(processors.process(logits, p, seen), by_hand)
    vllm = processors.apply_top_p(processors.apply_top_k(processors.apply_min_p(
        processors.apply_temperature(processors.apply_repetition_penalty(logits, seen, 1.2), 0.7), 0.05), 20), 0.8)
    assert torch.equal(process_like_vllm(logits, p, seen), vllm)
    assert not torch.equal(vllm, by_hand)  # the orders differ: the test can tell them apart


def test_greedy_applies_only_the_penalty_and_the_scan_ends_at_the_fold():
    logits = torch.randn(2, 30)
    greedy = SamplingParams(temperature=0, top_k=3, top_p=0.5)
    assert torch.equal(processors.process(logits, greedy, None), logits)
    p = SamplingParams(temperature=0.5, top_k=4)
    scan = processors.scan(logits, p, None)
    assert [s[0] for s in scan] == LISTED
    assert [s[2] for s in scan] == [False, True, True, False, False]
    assert torch.equal(scan[-1][3], processors.process(logits, p, None))


def test_a_user_processor_decodes_as_transformers_runs_it(tiny_lm):
    prompt = "hello world"
    trace = lmtrace.generate(tiny_lm, prompt, max_new_tokens=8, temperature=0, top_logprobs=2, stop_on_eos=False,
                             logits_processors=[no_top_token])  # fmt: skip
    ids = torch.tensor([trace.prompt["token_ids"]])
    out = tiny_lm.model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([AsTransformers(no_top_token, ids.shape[1])]),
                                 output_logits=True, return_dict_in_generate=True, eos_token_id=None)  # fmt: skip
    assert trace.token_ids == out.sequences[0, ids.shape[1] :].tolist()
    plain = lmtrace.generate(tiny_lm, prompt, max_new_tokens=8, temperature=0, stop_on_eos=False)
    assert plain.token_ids != trace.token_ids  # the processor changed the path
    for step, raw in zip(trace.steps, out.logits):
        assert step.logprob == pytest.approx(float(raw[0].log_softmax(-1)[step.token_id]), abs=1e-5)
    assert trace.params["logits_processors"] == ["no_top_token"]
    assert trace.steps[3].rank == 2  # the model's favourite was banned: the chosen token is its runner-up


def test_the_waterfall_lists_the_user_processor_by_name(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "hello", max_new_tokens=4, temperature=0.9, seed=3, waterfall="all",
                             logits_processors=[no_top_token])  # fmt: skip
    names = [s["stage"] for s in trace.steps[2].waterfall]
    assert names == ["raw", "no_top_token", *LISTED]
    banned = trace.steps[2].waterfall[1]
    assert banned["removed_mass"] > 0 and banned["allowed"] == trace.steps[2].waterfall[0]["allowed"] - 1


def test_a_user_processor_composes_with_a_draft_and_a_stream(tiny_lm):
    alone = lmtrace.generate(tiny_lm, "hello world", max_new_tokens=8, temperature=0, logits_processors=[no_top_token])
    drafted = lmtrace.generate(tiny_lm, "hello world", max_new_tokens=8, temperature=0, draft="layers:1",
                               draft_tokens=3, logits_processors=[no_top_token])  # fmt: skip
    assert drafted.token_ids == alone.token_ids
    streamed = [s.token_id for s in lmtrace.stream(tiny_lm, "hello world", max_new_tokens=8, temperature=0,
                                                   logits_processors=[no_top_token])]  # fmt: skip
    assert streamed == alone.token_ids


def test_bad_processors_are_named(tiny_lm):
    with pytest.raises(InvalidParameter, match="logits_processors: each must be a callable"):
        lmtrace.generate(tiny_lm, "hi", max_new_tokens=2, logits_processors=[3])

    def wrong(token_ids, logits):
        return logits[:5]

    with pytest.raises(GenerationError, match=r"logits_processors: wrong must return logits of shape"):
        lmtrace.generate(tiny_lm, "hi", max_new_tokens=2, logits_processors=[wrong])
