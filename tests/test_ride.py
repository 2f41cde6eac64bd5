"""A running batch's decode step rides in the forward of the prompts that join it
(lmtrace.decode.tree_prefill.Ride): one forward instead of a prefill and a decode step, and every
number the one each row gets alone (within the batched float noise)."""

from __future__ import annotations

import pytest
import torch

from lmtrace import SamplingParams
from lmtrace.decode import continuous, engine, tracing, tree_prefill
from lmtrace.decode.continuous import ContinuousBatch, RowSpec
from lmtrace.decode.prefill import PromptRow, prefill_many
from lmtrace.kv import ledger
from lmtrace.kv.prefix import PrefixCache
from tests.same_record import assert_same, one_thread  # noqa: F401
from tests.test_continuous import PROMPTS, SETTINGS, specs

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(lm, texts):
    """A left-padded batch's cache, mask and next tokens, as the continuous batch holds them."""
    ids, mask = engine.left_pad([tracing.encode_prompt(lm, t) for t in texts], lm.pad_token_id, lm.model.device)
    cache = ledger.new_cache(lm.model)
    logits = engine.prefill(lm.model, ids, mask, cache)
    return cache, mask, logits.argmax(-1), mask.sum(-1)


def test_the_riding_step_equals_the_decode_step_and_the_prompts_their_prefill(tiny_lm):
    model = tiny_lm.model
    with torch.inference_mode():
        cache, mask, tokens, positions = _batch(tiny_lm, ["Hello world", "Once upon a time there was"])
        layers = [(k.clone(), v.clone()) for k, v in ledger.layers_of(cache)]
        mask1 = torch.cat([mask, mask.new_ones((2, 1))], dim=-1)
        alone = engine.decode_step(model, tokens, positions[:, None], mask1, cache)  # the ordinary step
        prompts = [tracing.encode_prompt(tiny_lm, t) for t in ("The cat", "很久很久以前，")]
        lone = prefill_many(model, [PromptRow(p, top_n=3) for p in prompts], pad_id=0, keep_kv=True)
        ride = tree_prefill.Ride(layers, mask, tokens, positions)
        out = tree_prefill.forward(model, [tree_prefill.TreePrompt(list(p), 3) for p in prompts], ride)
    assert torch.allclose(ride.logits, alone, atol=1e-5)
    for (k, v), (new_k, new_v) in zip(ledger.layers_of(cache), ride.new):  # the column the step appended
        assert torch.allclose(new_k, k[:, :, -1:], atol=1e-5) and torch.allclose(new_v, v[:, :, -1:], atol=1e-5)
    for (last, numbers, kv), p in zip(out, lone):
        assert torch.allclose(last, p.logits, atol=1e-5)
        assert numbers.top_ids == p.numbers.top_ids
        assert torch.allclose(torch.tensor(numbers.logprob), torch.tensor(p.numbers.logprob), atol=1e-5)
        for (k, v), (k0, v0) in zip(kv, p.kv):
            assert k.shape == k0.shape and torch.allclose(k, k0, atol=1e-5) and torch.allclose(v, v0, atol=1e-5)


def test_rows_join_a_running_batch_in_its_decode_forward(tiny_lm):
    forwards = []
    hook = tiny_lm.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        batch = ContinuousBatch(tiny_lm, max_batch=4)
        rows = specs(tiny_lm)
        batch.join_many(rows[:2])
        batch.step()
        forwards.clear()
        batch.step(continuous.prefilling(tiny_lm, rows[2:4]))  # a short and a long prompt join
        assert len(forwards) == 1 and batch.stats["ridden"] == 1 and len(batch.rows) == 4
        done = {}
        while not batch.empty:
            for row in batch.step():
                done[id(row.spec)] = row.trace
    finally:
        hook.remove()
    for k, spec in enumerate(rows[:4]):
        alone = tracing.generate(tiny_lm, PROMPTS[k], SamplingParams(**SETTINGS[k]))
        assert done[id(spec)].token_ids == alone.token_ids
        assert_same(done[id(spec)].to_dict(), alone.to_dict(), tol=5e-5)


def test_a_lens_row_in_the_batch_keeps_joins_in_their_own_forward(tiny_lm):
    # the lens hooks the decode forward for its row alone: no prompt rides in it
    batch = ContinuousBatch(tiny_lm, max_batch=3)
    lens = RowSpec(tracing.encode_prompt(tiny_lm, "Hi"), SamplingParams(temperature=0, max_new_tokens=4), lens=True)
    batch.join_many([lens])
    joining = specs(tiny_lm)[:1]
    batch.step(continuous.prefilling(tiny_lm, joining))
    assert batch.stats["ridden"] == 0 and len(batch.rows) == 2
    while not batch.empty:
        for row in batch.step():
            if row.spec is joining[0]:
                alone = tracing.generate(tiny_lm, PROMPTS[0], SamplingParams(**SETTINGS[0]))
                assert_same(row.trace.to_dict(), alone.to_dict(), tol=5e-5)


def test_prompts_sharing_the_prefix_cache_ride_with_their_numbers(tiny_lm):
    # an echo request's prompts: measured, kept in the prefix cache, one reusing the other's beginning
    model = tiny_lm.model
    texts = ["Once upon a time there was a cat", "Once upon a time there was a dog who", "Hello"]
    rows = [PromptRow(tracing.encode_prompt(tiny_lm, t), top_n=2) for t in texts]
    with torch.inference_mode():
        cache, mask, tokens, positions = _batch(tiny_lm, ["Hi", "The weather today is"])
        layers = ledger.layers_of(cache)
        ride = tree_prefill.Ride(layers, mask, tokens, positions)
        rode = prefill_many(model, rows, pad_id=0, cache=PrefixCache(1 << 26), keep_kv=True, ride=ride)
        walked = prefill_many(model, rows, pad_id=0, cache=PrefixCache(1 << 26), keep_kv=True)
        mask1 = torch.cat([mask, mask.new_ones((2, 1))], dim=-1)
        step = engine.decode_step(model, tokens, positions[:, None], mask1, cache)
    assert ride.logits is not None and torch.allclose(ride.logits, step, atol=1e-5)
    assert sum(p.cached for p in rode) > 0  # the second prompt took the first's beginning
    for a, b in zip(rode, walked):
        assert a.cached == b.cached and a.numbers.top_ids == b.numbers.top_ids
        assert torch.allclose(a.logits, b.logits, atol=1e-5)
        assert torch.allclose(torch.tensor(a.numbers.logprob), torch.tensor(b.numbers.logprob), atol=1e-5)
