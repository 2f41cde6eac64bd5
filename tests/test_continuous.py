"""Continuous batching (lmtrace.decode.continuous): rows with different settings decode together, join
while others are mid-flight and leave when done, and each row's trace is the one it gets alone."""

from __future__ import annotations

import threading

import pytest
import torch

from lmtrace import SamplingParams
from lmtrace.decode import continuous, tracing
from lmtrace.decode.continuous import ContinuousBatch, RowSpec
from tests.same_record import assert_same, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Hello world", "Once upon a time there was", "很久很久以前，", "🙂", "The cat", "A B C D E F G"]
# every row its own settings: greedy, sampled with each processor, stop strings, lengths, alternatives
SETTINGS = [
    {"temperature": 0, "max_new_tokens": 9, "top_logprobs": 5},
    {"temperature": 0.8, "top_k": 20, "seed": 3, "max_new_tokens": 5, "top_logprobs": 2},
    {"temperature": 1.2, "top_p": 0.9, "seed": 4, "max_new_tokens": 12, "top_logprobs": 0},
    {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.3, "seed": 5, "max_new_tokens": 7},
    {"temperature": 0, "repetition_penalty": 1.5, "max_new_tokens": 11, "top_logprobs": 3},
    {"temperature": 1.0, "seed": 6, "max_new_tokens": 8, "stop": ["e"], "top_logprobs": 1},
]


def specs(lm) -> list[RowSpec]:
    return [
        RowSpec(tracing.encode_prompt(lm, text), SamplingParams(**kw), text)
        for text, kw in zip(PROMPTS, SETTINGS)
    ]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_batch", [6, 2, 1])
def test_mixed_settings_rows_joining_mid_flight_get_their_alone_traces(tiny_lm, max_batch, overlap):
    # max_batch 2: rows join as others finish (different lengths), into caches of other widths
    together = continuous.generate_rows(tiny_lm, specs(tiny_lm), max_batch=max_batch, overlap=overlap)
    for text, kw, trace in zip(PROMPTS, SETTINGS, together):
        alone = tracing.generate(tiny_lm, text, SamplingParams(**kw))
        assert trace.token_ids == alone.token_ids, text
        assert_same(trace.to_dict(), alone.to_dict(), tol=5e-5)  # the KV record too: batch 1, no padding


def test_a_row_joins_a_running_batch_between_steps(tiny_lm):
    batch = ContinuousBatch(tiny_lm, max_batch=4)
    short, long_ = specs(tiny_lm)[3], specs(tiny_lm)[1]
    first = batch.join(specs(tiny_lm)[0])
    for _ in range(3):
        assert batch.step() == []
    # a longer prompt joins: the running row's cache is padded on the left, its numbers unchanged
    late = batch.join(long_)
    batch.step()
    shorter = batch.join(short)
    assert batch.mask.shape[0] == 3
    done = {}
    while not batch.empty:
        for row in batch.step():
            done[id(row)] = row.trace
    for row, k in zip((first, late, shorter), (0, 1, 3)):
        text, kw = PROMPTS[k], SETTINGS[k]
        alone = tracing.generate(tiny_lm, text, SamplingParams(**kw))
        assert_same(done[id(row)].to_dict(), alone.to_dict(), tol=5e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_row_whose_consumer_fails_leaves_alone(tiny_lm, overlap):
    def stop(step):
        if step.index == 2:
            raise RuntimeError("client gone")

    rows = specs(tiny_lm)[:3]
    rows[1].on_step = stop
    batch = ContinuousBatch(tiny_lm, max_batch=3, overlap=overlap)
    joined = [batch.join(s) for s in rows]
    left = []
    while not batch.empty:
        left += batch.step()
    assert isinstance(joined[1].error, RuntimeError) and len(joined[1].steps) == 3
    alone = tracing.generate(tiny_lm, PROMPTS[2], SamplingParams(**SETTINGS[2]))
    assert_same(joined[2].trace.to_dict(), alone.to_dict(), tol=5e-5)


def test_the_cache_keeps_only_what_remaining_rows_need(tiny_lm):
    batch = ContinuousBatch(tiny_lm, max_batch=2)
    long_ = RowSpec(tracing.encode_prompt(tiny_lm, PROMPTS[1]), SamplingParams(temperature=0, max_new_tokens=2))
    short = RowSpec(tracing.encode_prompt(tiny_lm, "Hi"), SamplingParams(temperature=0, max_new_tokens=6))
    batch.join(long_)
    batch.join(short)
    batch.step()
    batch.step()  # the long row leaves: the padding only it needed goes
    assert len(batch.rows) == 1 and bool((batch.mask == 1).all())
    assert batch.cache.layers[0].keys.shape[2] == batch.mask.shape[1] == len(short.ids) + 2
    assert torch.equal(batch.mask, torch.ones_like(batch.mask))


def run_overlapped(lm, rows: list[RowSpec], max_batch: int) -> tuple[list, ContinuousBatch]:
    """generate_rows's loop with overlap, the batch kept for its stats."""
    batch = ContinuousBatch(lm, max_batch=max_batch, overlap=True)
    waiting, out = list(enumerate(rows)), [None] * len(rows)
    while waiting or not batch.empty:
        arriving, waiting = waiting[: batch.free], waiting[batch.free :]
        riding = [spec for _, spec in arriving if batch.rows]
        batch.join_many([spec for _, spec in arriving if not batch.rows])
        for row in batch.step(continuous.prefilling(lm, riding) if riding else None):
            out[next(i for i, s in enumerate(rows) if s is row.spec)] = row.trace
    return out, batch


def test_a_step_measured_beside_the_next_forward_records_the_same_numbers_bit_for_bit(tiny_lm):
    # overlap: the numbers come from the same logits on another thread while the next forward
    # runs from the picked tokens; rows that end by length or end token leave before it, so the
    # batch is the same at every step and so is every number
    rows = [s for s in specs(tiny_lm) if not s.params.stop]
    threads: set[str] = set()
    for spec in rows:
        spec.on_step = lambda step: threads.add(threading.current_thread().name)
    together, batch = run_overlapped(tiny_lm, rows, max_batch=3)
    serial = continuous.generate_rows(tiny_lm, [s for s in specs(tiny_lm) if not s.params.stop], max_batch=3)
    assert batch.stats["overlapped"] >= batch.stats["steps"] > 0 and batch.stats["ridden"] > 0
    assert [t.startswith("lmtrace-measure") for t in threads] == [True]  # on_step: on the measuring thread
    for got, want in zip(together, serial):
        assert got.token_ids == want.token_ids
        assert_same(got.to_dict(), want.to_dict(), tol=0.0)


def test_a_row_a_stop_string_ends_leaves_after_the_forward_with_its_alone_trace(tiny_lm):
    # the stop string is found by the row's record, beside the forward the row is still in
    free = tracing.generate(tiny_lm, PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=8))
    stop = tiny_lm.tokenizer.decode(free.token_ids[:3]).strip()[-1:]  # met before its length
    kw = {"temperature": 0, "max_new_tokens": 8, "stop": [stop], "top_logprobs": 2}
    alone = tracing.generate(tiny_lm, PROMPTS[1], SamplingParams(**kw))
    assert alone.finish_reason == "stop" and len(alone.token_ids) < kw["max_new_tokens"]
    rows = specs(tiny_lm)
    rows[1] = RowSpec(tracing.encode_prompt(tiny_lm, PROMPTS[1]), SamplingParams(**kw), PROMPTS[1])
    together, batch = run_overlapped(tiny_lm, rows, max_batch=6)
    assert batch.stats["overlapped"] >= batch.stats["steps"] > len(alone.token_ids)
    assert_same(together[1].to_dict(), alone.to_dict(), tol=5e-5)
    for k in (0, 2, 3, 4):  # the others decode on after it left
        alone = tracing.generate(tiny_lm, PROMPTS[k], SamplingParams(**SETTINGS[k]))
        assert_same(together[k].to_dict(), alone.to_dict(), tol=5e-5)


def test_rows_with_a_grammar_or_observers_are_measured_before_the_forward(tiny_lm):
    spec = specs(tiny_lm)[0]
    spec.params = SamplingParams(temperature=0, max_new_tokens=4, regex="[ab]{6}")  # no end before 4 tokens
    plain = RowSpec(tracing.encode_prompt(tiny_lm, PROMPTS[1]), SamplingParams(temperature=0, max_new_tokens=4))
    batch = ContinuousBatch(tiny_lm, max_batch=2, overlap=True)
    batch.join_many([spec, plain])  # the grammar moves past each token before the next step
    while not batch.empty:
        batch.step()
    assert batch.stats["steps"] > 0 and batch.stats["overlapped"] == 0
