"""watch() on people's own loops: the re-feeding mistake is caught with exact cache lengths,
a right loop stays silent."""

from __future__ import annotations

import warnings

import pytest
import torch

import lmtrace
from lmtrace.external.misuse import run_loop
from lmtrace.kv import ledger as kv


def refeed_lengths(n: int, rounds: int) -> list[int]:
    return [(k + 1) * n + k * (k + 1) // 2 for k in range(rounds)]


def test_refeeding_loop_is_caught_at_round_1_with_exact_lengths(tiny_lm):
    ids = lmtrace.encode_prompt(tiny_lm, "Hello world, the quick")
    n = len(ids)
    with pytest.warns(lmtrace.CacheMisuseWarning, match=r"round 1: fed .* where .* were expected\. Fix: feed only"):
        run = run_loop(tiny_lm, ids, 5, refeed=True)
    w = run.watch
    assert [r.cache_len_after for r in w.rounds] == refeed_lengths(n, 5)
    assert [r.input_len for r in w.rounds] == [n + k for k in range(5)]
    first = w.problems[0]
    assert (first.round, first.kind) == (1, "refed_tokens")
    assert (first.expected_cache_len, first.actual_cache_len) == (n + 1, 2 * n + 1)
    assert [p.round for p in w.problems] == [1, 2, 3, 4]
    assert f"holds {2 * n + 1} positions where {n + 1} were expected" in first.message


def test_right_loop_gets_no_problem_and_no_warning(tiny_lm):
    ids = lmtrace.encode_prompt(tiny_lm, "Hello world, the quick")
    with warnings.catch_warnings():
        warnings.simplefilter("error", lmtrace.CacheMisuseWarning)
        run = run_loop(tiny_lm, ids, 5, refeed=False)
    assert run.watch.problems == [] and run.watch.ok
    assert [r.cache_len_after for r in run.watch.rounds] == [len(ids) + k for k in range(5)]
    assert [r.input_len for r in run.watch.rounds] == [len(ids)] + [1] * 4
    r = run.watch.rounds[1]
    assert r.logits_shape == [1, 1, tiny_lm.summary.vocab_size]
    assert r.layer_shapes[0] == [1, 2, len(ids) + 1, 16]


def test_right_loop_matches_the_tracer(tiny_lm):
    ids = lmtrace.encode_prompt(tiny_lm, "Hello world")
    run = run_loop(tiny_lm, ids, 6, refeed=False)
    assert run.tokens == lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=6, temperature=0,
                                          stop_on_eos=False).token_ids  # fmt: skip


def test_positions_that_do_not_continue_the_cache(tiny_lm):
    model = tiny_lm.model
    ids = torch.tensor([lmtrace.encode_prompt(tiny_lm, "Hello world")])
    cache = kv.new_cache(model)
    with pytest.warns(lmtrace.CacheMisuseWarning, match="position ids start at 0"):
        with lmtrace.watch(model) as w, torch.no_grad():
            model(ids, cache=cache, use_cache=True)
            model(ids[:, :1], cache=cache, use_cache=True, position_ids=torch.tensor([[0]]))
    assert [p.kind for p in w.problems] == ["positions"]


def test_cache_reused_for_another_prompt(tiny_lm):
    model = tiny_lm.model
    first = lmtrace.encode_prompt(tiny_lm, "Hello world")
    other = [first[0]] + lmtrace.encode_prompt(tiny_lm, " the quick brown")
    cache = kv.new_cache(model)
    with pytest.warns(lmtrace.CacheMisuseWarning, match="reused for a new prompt"):
        with lmtrace.watch(model) as w, torch.no_grad():
            model(torch.tensor([first]), cache=cache, use_cache=True)
            model(torch.tensor([other]), cache=cache, use_cache=True)
    assert [p.kind for p in w.problems] == ["different_prompt"]


def test_watch_reads_the_old_keyword_too(tiny_lm):
    model = tiny_lm.model
    ids = torch.tensor([lmtrace.encode_prompt(tiny_lm, "Hello world")])
    cache = kv.new_cache(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.warns(lmtrace.CacheMisuseWarning):
            with lmtrace.watch(model) as w, torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True)
                model(torch.cat([ids, ids[:, :1]], 1), past_key_values=cache, use_cache=True)
    n = ids.shape[1]
    assert [(r.cache_len_before, r.cache_len_after) for r in w.rounds] == [(0, n), (n, 2 * n + 1)]
    assert w.problems[0].kind == "refed_tokens"


def test_hooks_are_removed_on_exit(tiny_lm):
    with lmtrace.watch(tiny_lm.model) as w:
        pass
    with torch.no_grad():
        tiny_lm.model(torch.tensor([[5, 6]]))
    assert w.rounds == []
