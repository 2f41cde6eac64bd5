"""watch() follows what a loop really feeds: any number of tokens per round, one row or a ragged
batch. Five wrong loops (re-feeding, two tokens per round, argmax over the wrong axis, a cache from
the wrong round, positions not advanced) each get a problem whose advice fits that loop, and the
trace shows exactly the text the loop produced; four right loops stay silent and trace like
lmtrace.generate."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import lmtrace
from lmtrace.kv import ledger as kv
from tests.test_from_generate import assert_equal

PROMPT = "Hello world, the quick"


def call(model, ids, cache, **kw):
    return model(ids, **kv.cache_kwargs(model, cache), **kw).logits


def two_per_round_refeeding(model, ids, rounds):
    """The issue's loop: the whole sequence fed again, the last position's two best appended."""
    cache, seq = kv.new_cache(model), ids
    for _ in range(rounds):
        logits = call(model, seq, cache)
        seq = torch.cat([seq, logits.topk(2).indices[:, -1]], dim=1)  # (batch, seq, 2) -> (batch, 2)
    return seq


def argmax_every_position(model, ids, rounds):
    """argmax over the sequence's positions kept whole: logits.argmax(-1) is (batch, seq)."""
    cache, seq, step = kv.new_cache(model), ids, ids
    for _ in range(rounds):
        step = call(model, step, cache).argmax(-1)
        seq = torch.cat([seq, step], dim=1)
    return seq


def cache_of_round_0(model, ids, rounds):
    """Each round decodes from a copy of the prompt's cache instead of the cache the last call filled."""
    prefix = kv.new_cache(model)
    step = call(model, ids, prefix)[:, -1].argmax(-1, keepdim=True)
    seq = torch.cat([ids, step], dim=1)
    for _ in range(rounds - 1):
        step = call(model, step, copy.deepcopy(prefix))[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, step], dim=1)
    return seq


def positions_stuck(model, ids, rounds):
    """Position ids computed once, after the prompt, and never advanced."""
    cache, n = kv.new_cache(model), ids.shape[1]
    step = call(model, ids, cache)[:, -1].argmax(-1, keepdim=True)
    seq = torch.cat([ids, step], dim=1)
    for _ in range(rounds - 1):
        step = call(model, step, cache, position_ids=torch.tensor([[n]]))[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, step], dim=1)
    return seq


def watched(lm, loop, rounds=4, ids=None):
    ids = ids if ids is not None else torch.tensor([lmtrace.encode_prompt(lm, PROMPT)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", lmtrace.CacheMisuseWarning)
        with lmtrace.watch(lm.model, record=True) as w, torch.no_grad():
            seq = loop(lm.model, ids, rounds)
    return w, seq, caught


def test_two_tokens_per_round_advice_and_text(tiny_lm):
    w, seq, caught = watched(tiny_lm, two_per_round_refeeding)
    n = len(lmtrace.encode_prompt(tiny_lm, PROMPT))
    first = w.problems[0]
    assert (first.round, first.kind, first.expected_cache_len) == (1, "refed_tokens", n + 2)
    assert f"fed {n + 2} tokens, the loop's whole sequence" in first.message
    assert "only 2 are new" in first.message and "model(input_ids[:, -2:], cache=cache)" in first.message
    assert "[:, -1:]" not in first.message
    assert caught and caught[0].filename == __file__  # the warning points at the user's own line
    trace = w.trace(tiny_lm.tokenizer, tokens=seq)  # the whole sequence, as the message promises
    assert trace.token_ids == seq[0, n:].tolist() and len(trace.steps) == 8
    assert trace.text == tiny_lm.tokenizer.decode(seq[0, n:])
    assert [s.rank for s in trace.steps] == [1, 2] * 4  # both from the last position of the same round
    assert [s.kv["round"] for s in trace.steps] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.kv["expected_seq_len"] for s in trace.steps] == [n, n, n + 2, n + 2, n + 4, n + 4, n + 6, n + 6]
    assert trace.steps[2].problems[0]["round"] == 1 and trace.steps[1].problems is None
    without = w.trace(tiny_lm.tokenizer)  # the last round's two choices were never fed back
    assert without.token_ids == seq[0, n:-2].tolist()
    assert without.text == tiny_lm.tokenizer.decode(seq[0, n:-2])
    choices = w.trace(tiny_lm.tokenizer, tokens=seq[0, n:])
    assert choices.token_ids == trace.token_ids


def test_argmax_over_the_wrong_axis(tiny_lm):
    w, seq, _ = watched(tiny_lm, argmax_every_position, rounds=3)
    n = len(lmtrace.encode_prompt(tiny_lm, PROMPT))
    assert [p.kind for p in w.problems] == ["all_positions", "all_positions"]
    message = w.problems[0].message
    assert f"fed {n} tokens, the model's argmax at each of the {n} positions of round 0" in message
    assert "logits[:, -1, :].argmax(-1, keepdim=True)" in message
    trace = w.trace(tiny_lm.tokenizer, tokens=seq)
    assert trace.token_ids == seq[0, n:].tolist() and trace.text == tiny_lm.tokenizer.decode(seq[0, n:])


def test_cache_from_an_earlier_round(tiny_lm):
    w, seq, _ = watched(tiny_lm, cache_of_round_0, rounds=4)
    n = len(lmtrace.encode_prompt(tiny_lm, PROMPT))
    assert [(p.round, p.kind) for p in w.problems] == [(2, "stale_cache"), (3, "stale_cache")]
    message = w.problems[0].message
    assert f"the cache as it was after round 0 ({n} positions) while the loop's sequence already holds {n + 1}" in (
        message
    )
    assert "pass the cache the previous call filled" in message
    assert w.trace(tiny_lm.tokenizer, tokens=seq).token_ids == seq[0, n:].tolist()


def test_a_new_cache_every_round(tiny_lm):
    def fresh(model, ids, rounds):
        step = call(model, ids, kv.new_cache(model))[:, -1].argmax(-1, keepdim=True)
        for _ in range(rounds - 1):
            step = call(model, step, kv.new_cache(model))[:, -1].argmax(-1, keepdim=True)

    w, _, _ = watched(tiny_lm, fresh, rounds=3)
    assert [p.kind for p in w.problems] == ["stale_cache", "stale_cache"]
    assert "with a new, empty cache (0 positions)" in w.problems[0].message


def test_positions_not_advanced(tiny_lm):
    w, seq, _ = watched(tiny_lm, positions_stuck, rounds=4)
    n = len(lmtrace.encode_prompt(tiny_lm, PROMPT))
    assert [(p.round, p.kind) for p in w.problems] == [(2, "positions"), (3, "positions")]
    assert f"position ids start at {n} but the cache holds {n + 1} positions" in w.problems[0].message
    assert "leave position_ids out" in w.problems[0].message


def test_refeeding_one_token_per_round_says_one_new_token(tiny_lm):
    from tests.test_watch_trace import second_best_refeeding_loop

    w, _, _ = watched(tiny_lm, second_best_refeeding_loop)
    assert "only 1 is new" in w.problems[0].message and "model(input_ids[:, -1:], cache=cache)" in w.problems[0].message


def _plain(trace):
    """The raw numbers only: a watched loop's processing is not known."""
    for s in trace.steps:
        s.sampled_logprob = s.sampled_entropy = None
        for a in s.top:
            a.sampled_logprob = None
    trace.params = {}
    return trace


def test_right_loop_without_a_cache(tiny_lm):
    def no_cache(model, ids, rounds):
        seq = ids
        for _ in range(rounds):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return seq

    w, seq, caught = watched(tiny_lm, no_cache, rounds=5)
    assert w.problems == [] and caught == []
    want = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=5, temperature=0, stop_on_eos=False)
    assert_equal(_plain(w.trace(tiny_lm.tokenizer, tokens=seq)), _plain(want))


def test_right_loop_feeding_two_new_tokens_per_round(tiny_lm):
    forced = lmtrace.encode_prompt(tiny_lm, " x")[-1]

    def two_new(model, ids, rounds):
        cache, seq, step = kv.new_cache(model), ids, ids
        for _ in range(rounds):
            best = call(model, step, cache)[:, -1].argmax(-1, keepdim=True)
            step = torch.cat([best, best.new_tensor([[forced]])], dim=1)  # a chosen token and a forced one
            seq = torch.cat([seq, step], dim=1)
        return seq

    w, seq, caught = watched(tiny_lm, two_new, rounds=4)
    assert w.problems == [] and caught == []
    trace = w.trace(tiny_lm.tokenizer, tokens=seq)
    assert all(s.kv["seq_len"] == s.kv["expected_seq_len"] for s in trace.steps)
    assert [s.rank for s in trace.steps][::2] == [1] * 4
    assert trace.text == tiny_lm.tokenizer.decode(seq[0, len(lmtrace.encode_prompt(tiny_lm, PROMPT)) :])


def test_right_ragged_batch_traces_each_row(tiny_lm):
    tok = tiny_lm.tokenizer
    prompts = [PROMPT, "Hi there"]
    rows = [lmtrace.encode_prompt(tiny_lm, p) for p in prompts]
    width, pad = max(map(len, rows)), tiny_lm.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def batched(model, ids, rounds):
        cache, m, step = kv.new_cache(model), mask, ids
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        seq = ids
        for _ in range(rounds):
            logits = call(model, step, cache, attention_mask=m, position_ids=pos)
            step = logits[:, -1].argmax(-1, keepdim=True)
            seq, m = torch.cat([seq, step], 1), torch.cat([m, torch.ones_like(step)], 1)
            pos = pos[:, -1:] + 1
        return seq

    w, seq, caught = watched(tiny_lm, batched, rounds=5, ids=ids)
    assert w.problems == [] and caught == []
    for row, prompt in enumerate(prompts):
        got = w.trace(tok, row=row, tokens=seq)
        assert got.prompt["token_ids"] == rows[row]
        want = lmtrace.generate(tiny_lm, prompt, max_new_tokens=5, temperature=0, stop_on_eos=False)
        assert got.token_ids == want.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.steps, want.steps)) < 1e-4


def test_tokens_that_disagree_with_the_loop_are_named(tiny_lm):
    w, seq, _ = watched(tiny_lm, two_per_round_refeeding, rounds=3)
    with pytest.raises(lmtrace.InvalidParameter, match=r"^tokens: expected the loop's whole sequence .* choice 0"):
        w.trace(tiny_lm.tokenizer, tokens=[7, 7, 7, 7, 7, 7])


def test_watched_trace_has_the_model_name_and_times(tiny_lm):
    w, seq, _ = watched(tiny_lm, two_per_round_refeeding, rounds=3)
    trace = w.trace(tiny_lm.tokenizer, tokens=seq)
    t = trace.timing
    assert t["prefill_ms"] > 0 and t["decode_ms"] > 0
    assert t["total_ms"] == pytest.approx(t["prefill_ms"] + t["decode_ms"])
    assert trace.steps[0].time_ms == pytest.approx(t["prefill_ms"]) and trace.steps[1].time_ms is None
