"""The batched prefill (lmtrace.decode.prefill) and the prefix cache (lmtrace.kv.prefix): every
number equals lone teacher forcing within the batched-versus-alone bound, a prompt never gets
another prompt's numbers where they differ, the cache stays within its bytes, and it forgets
everything when the weights change."""

from __future__ import annotations

import pytest
import torch

from lmtrace.decode import engine
from lmtrace.decode.prefill import PromptRow, groups, prefill_many
from lmtrace.decode.tree_prefill import common
from lmtrace.kv import ledger
from lmtrace.kv.prefix import PrefixCache
from lmtrace.logits import measure

BOUND = 1e-5  # batched (padded, cached) versus alone, float32 (measured: < 3e-6 on the tiny model)

TEXTS = [
    "Hello world, the quick brown fox jumps",
    "Hello world, the quick brown fox sleeps over",
    "Once upon a time there was",
    "Hello world, the quick brown",
    "Hello world, the quick brown fox jumps over the lazy dog.",
]


def alone(lm, ids: list[int], top_n: int = 3) -> tuple[measure.Forced, torch.Tensor]:
    """Lone teacher forcing: one uncached forward over the whole prompt."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), use_cache=False).logits[0].float()  # (len, vocab)
    return measure.targets(logits[:-1], torch.tensor(ids[1:]), top_n), logits[-1]


def gap(lm, ids: list[int], done) -> float:
    """The largest difference between a prefilled prompt's numbers and lone teacher forcing;
    ranks and alternatives must be the same."""
    numbers, last = alone(lm, ids)
    assert done.numbers.rank == numbers.rank and done.numbers.top_ids == numbers.top_ids
    assert len(done.numbers.logprob) == len(ids) - 1 and done.kv[0][0].shape[2] == len(ids)
    diffs = [abs(a - b) for a, b in zip(done.numbers.logprob, numbers.logprob)]
    diffs += [abs(a - b) for a, b in zip(done.numbers.entropy, numbers.entropy)]
    return max([*diffs, (done.logits - last).abs().max().item()])


def encode(lm, texts: list[str]) -> list[list[int]]:
    return [lm.tokenizer(t)["input_ids"] for t in texts]


def test_batched_and_cached_numbers_equal_lone_teacher_forcing(tiny_lm):
    ids = encode(tiny_lm, TEXTS)
    cache = PrefixCache(1 << 26)
    first = prefill_many(tiny_lm.model, [PromptRow(i, 3) for i in ids], pad_id=tiny_lm.pad_token_id, cache=cache)
    # the four that begin alike computed their beginning once (the shortest is all of it)
    assert [p.cached >= 16 for p in first] == [True, True, False, False, True] and first[3].cached == 0
    assert max(gap(tiny_lm, i, p) for i, p in zip(ids, first)) < BOUND
    again = prefill_many(tiny_lm.model, [PromptRow(i, 3) for i in ids], pad_id=tiny_lm.pad_token_id, cache=cache)
    assert [p.cached for p in again] == [len(i) for i in ids]  # asked before: from the cache alone
    for a, b in zip(first, again):  # the same numbers to the bit
        assert a.numbers == b.numbers and torch.equal(a.logits, b.logits)


def test_one_pack_computes_a_shared_beginning_once(tiny_lm):
    """Duplicates, a prompt and its extension, and prompts parting after a common beginning,
    in one call: one forward without padding, each prompt's own numbers."""
    ids = encode(tiny_lm, [TEXTS[0], TEXTS[0], TEXTS[3], TEXTS[4], TEXTS[1], TEXTS[2]])
    cache = PrefixCache(1 << 26)
    calls = []
    hook = tiny_lm.model.register_forward_pre_hook(
        lambda m, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    try:
        done = prefill_many(tiny_lm.model, [PromptRow(i, 3) for i in ids], pad_id=tiny_lm.pad_token_id, cache=cache)
    finally:
        hook.remove()
    tree = sorted(ids[:5])  # side by side, each shares the most with the one before
    unique = len(tree[0]) + sum(len(b) - common(a, b) for a, b in zip(tree, tree[1:])) + len(ids[5])
    assert calls == [(1, unique)]  # every token of the tree once, no padding
    order = sorted(range(len(ids)), key=lambda i: ids[i])  # each takes what it shares with the one before
    shared = {b: common(ids[a], ids[b]) for a, b in zip(order, order[1:])}
    assert [p.cached for p in done] == [shared.get(i, 0) if shared.get(i, 0) > 8 else 0 for i in range(len(ids))]
    assert max(gap(tiny_lm, i, p) for i, p in zip(ids, done)) < BOUND
    assert done[0].numbers == done[1].numbers and torch.equal(done[0].logits, done[1].logits)


def test_a_row_alone_without_a_cache_is_the_engines_prefill_to_the_bit(tiny_lm):
    ids = encode(tiny_lm, TEXTS[:1])[0]
    with torch.inference_mode():
        cache = ledger.new_cache(tiny_lm.model)
        expected = engine.prefill(tiny_lm.model, torch.tensor([ids]), None, cache)[0]
    (done,) = prefill_many(tiny_lm.model, [PromptRow(ids)], pad_id=tiny_lm.pad_token_id, keep_kv=True)
    assert torch.equal(done.logits, expected) and done.numbers is None
    assert all(torch.equal(k, ck) for (k, _), (ck, _) in zip(done.kv, ledger.layers_of(cache)))


def test_prompts_differing_only_in_their_last_token_never_share_its_number(tiny_lm):
    tok = tiny_lm.tokenizer
    base = encode(tiny_lm, ["Once upon a time there was a little model that counted"])[0]
    a, b = base + tok(" tokens")["input_ids"][:1], base + tok(" world")["input_ids"][:1]
    assert a[-1] != b[-1]
    cache = PrefixCache(1 << 26)
    (pa,) = prefill_many(tiny_lm.model, [PromptRow(a, 3)], pad_id=tiny_lm.pad_token_id, cache=cache)
    (pb,) = prefill_many(tiny_lm.model, [PromptRow(b, 3)], pad_id=tiny_lm.pad_token_id, cache=cache)
    assert pb.cached == len(b) - 2  # the last shared token again (its distribution predicts where they part)
    assert gap(tiny_lm, b, pb) < BOUND
    lone_b, _ = alone(tiny_lm, b)
    assert pb.numbers.logprob[-1] == pytest.approx(lone_b.logprob[-1], abs=BOUND)
    assert abs(pb.numbers.logprob[-1] - pa.numbers.logprob[-1]) > 1e-3  # really another number


def test_after_a_long_shared_prefix_each_continuation_gets_its_own_numbers(tiny_lm):
    prefix = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
    ends = [" Hello world", " Once upon a time", " 很久很久以前", " Hello there"]
    ids = encode(tiny_lm, [prefix + e for e in ends])
    assert len(ids[0]) > 60
    cache = PrefixCache(1 << 26)
    done = prefill_many(tiny_lm.model, [PromptRow(i, 3) for i in ids], pad_id=tiny_lm.pad_token_id, cache=cache)
    assert sorted(p.cached for p in done)[1] > 50  # the others reused the first one's beginning
    assert max(gap(tiny_lm, i, p) for i, p in zip(ids, done)) < BOUND
    # one at a time, each after all the others: still its own numbers
    for i in reversed(ids):
        (p,) = prefill_many(tiny_lm.model, [PromptRow(i + [5], 3)], pad_id=tiny_lm.pad_token_id, cache=cache)
        assert p.cached == len(i) and gap(tiny_lm, i + [5], p) < BOUND


def test_the_cache_stays_within_its_bytes_and_evicts_the_least_recently_used(tiny_lm):
    ids = encode(tiny_lm, [f"{t} number {n}" for n in range(6) for t in TEXTS])
    one = PrefixCache(1 << 30)
    prefill_many(tiny_lm.model, [PromptRow(ids[0], 3)], pad_id=tiny_lm.pad_token_id, cache=one)
    limit = one.bytes * 4  # room for about four prompts
    cache = PrefixCache(limit)
    for i in ids:
        (p,) = prefill_many(tiny_lm.model, [PromptRow(i, 3)], pad_id=tiny_lm.pad_token_id, cache=cache)
        assert cache.bytes <= limit and gap(tiny_lm, i, p) < BOUND
    assert cache.stats.peak_bytes <= limit and cache.stats.evictions > 0 and 2 <= len(cache) <= 5
    # the most recent prompt is still there; the first is long gone
    assert cache.lookup(ids[-1], 3).reuse == len(ids[-1])
    (p,) = prefill_many(tiny_lm.model, [PromptRow(ids[0], 3)], pad_id=tiny_lm.pad_token_id, cache=cache)
    assert p.cached < len(ids[0]) and gap(tiny_lm, ids[0], p) < BOUND


def test_a_prompt_larger_than_the_cache_still_works(tiny_lm):
    ids = encode(tiny_lm, [TEXTS[4] * 3])[0]
    cache = PrefixCache(1000)  # smaller than any prompt's KV
    for _ in range(2):
        (p,) = prefill_many(tiny_lm.model, [PromptRow(ids, 3)], pad_id=tiny_lm.pad_token_id, cache=cache)
        assert p.cached == 0 and gap(tiny_lm, ids, p) < BOUND
    assert cache.bytes == 0 and len(cache) == 0 and cache.stats.skipped == 2


def test_changed_weights_empty_the_cache(tiny_tok):
    from lmtrace.model.lm import LM
    from tests.tiny import tiny_model

    lm = LM.from_objects(tiny_model(tiny_tok, seed=3), tiny_tok, source="tiny-changing")
    ids = encode(lm, TEXTS[:1])[0]
    cache = PrefixCache(1 << 26)
    prefill_many(lm.model, [PromptRow(ids, 3)], pad_id=lm.pad_token_id, cache=cache)
    with torch.no_grad():
        lm.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # in place: torch counts it
    (p,) = prefill_many(lm.model, [PromptRow(ids, 3)], pad_id=lm.pad_token_id, cache=cache)
    assert p.cached == 0 and cache.stats.cleared == 1 and gap(lm, ids, p) < BOUND
    lm.model.lm_head.weight = torch.nn.Parameter(lm.model.lm_head.weight.detach() * 0.5)  # replaced
    (p,) = prefill_many(lm.model, [PromptRow(ids, 3)], pad_id=lm.pad_token_id, cache=cache)
    assert p.cached == 0 and cache.stats.cleared == 2 and gap(lm, ids, p) < BOUND


def test_more_alternatives_than_cached_are_computed_again(tiny_lm):
    ids = encode(tiny_lm, TEXTS[:1])[0]
    cache = PrefixCache(1 << 26)
    prefill_many(tiny_lm.model, [PromptRow(ids, 1)], pad_id=tiny_lm.pad_token_id, cache=cache)
    (p,) = prefill_many(tiny_lm.model, [PromptRow(ids, 3)], pad_id=tiny_lm.pad_token_id, cache=cache)
    assert p.cached == 0 and all(len(t) == 3 for t in p.numbers.top_ids)
    (p,) = prefill_many(tiny_lm.model, [PromptRow(ids, 2)], pad_id=tiny_lm.pad_token_id, cache=cache)
    assert p.cached == len(ids) and all(len(t) == 2 for t in p.numbers.top_ids)


def test_rows_that_do_not_share_neither_reuse_nor_fill_the_cache(tiny_lm):
    ids = encode(tiny_lm, TEXTS[:2])
    cache = PrefixCache(1 << 26)
    rows = [PromptRow(i, 3, share=False) for i in ids]
    done = prefill_many(tiny_lm.model, rows, pad_id=tiny_lm.pad_token_id, cache=cache)
    assert [p.cached for p in done] == [0, 0] and len(cache) == 0


def test_groups_keep_measured_rows_apart_and_padding_bounded():
    sizes = {0: 5, 1: 50, 2: 6, 3: 7, 4: 300}
    out = groups([0, 1, 2, 3, 4], sizes, [True, True, True, False, True], max_rows=2, max_tokens=100)
    assert out == [[3], [0, 2], [1], [4]]
