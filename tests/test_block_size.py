"""`draft_tokens="auto"` (lmtrace.decode.block_size): the block size that makes the most tokens a
second from the run's measured acceptance and costs, and a run with it gives plain decoding's
tokens and numbers."""

from __future__ import annotations

import pytest

import lmtrace
from lmtrace.decode.block_size import FIRST, MAX_AUTO, BlockSize, expected_tokens

GREEDY = {"max_new_tokens": 24, "temperature": 0, "top_logprobs": 3, "stop_on_eos": False}


def _measured(size: BlockSize, verdicts: list[bool], verify: dict[int, float], draft_step: float) -> None:
    for rows, seconds in verify.items():
        size.measured(verdicts, draft_step * (rows - 1), rows - 1, seconds, rows)


def test_a_fixed_k_stays_fixed():
    size = BlockSize.of(3)
    _measured(size, [True, True, True], {4: 1.0}, 0.01)
    assert size.next() == 3 and size.largest == 3


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_auto_starts_at_first_then_follows_the_costs():
    size = BlockSize.of("auto")
    assert size.next() == FIRST and size.largest == MAX_AUTO
    # every proposal accepted, a verify forward costing the same for any row count (oneDNN's
    # packed kernel), a cheap draft: the largest block
    for _ in range(20):
        _measured(size, [True] * 4, {2: 0.05, 5: 0.05}, 0.005)
    assert size.rate > 0.9 and size.next() == MAX_AUTO
    # most proposals rejected, a verify forward whose cost grows with its rows, a dear draft: one
    size = BlockSize.of("auto")
    for _ in range(20):
        _measured(size, [False], {2: 0.05, 5: 0.11}, 0.04)
    assert size.rate < 0.2 and size.next() == 1


def test_auto_picks_the_k_of_the_most_tokens_a_second():
    size = BlockSize.of("auto")
    for _ in range(30):
        _measured(size, [True, True, True, False], {2: 0.05, 4: 0.05}, 0.01)
    rate = size.rate
    best = max(range(1, MAX_AUTO + 1), key=lambda k: expected_tokens(rate, k) / (k * size.draft_s + size.verify(k + 1)))
    assert size.next() == best and 1 < best < MAX_AUTO


@pytest.mark.parametrize("draft", ["layers:1"])
def test_an_auto_run_gives_plain_decodings_tokens_and_numbers(tiny_lm, draft):
    plain = lmtrace.generate(tiny_lm, "Hello world, the quick", **GREEDY)
    fast = lmtrace.generate(tiny_lm, "Hello world, the quick", **GREEDY, draft=draft, draft_tokens="auto")
    assert fast.token_ids == plain.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(fast.steps, plain.steps)) < 1e-4
    spec = fast.speculative
    assert spec["draft_tokens"] == "auto" and sum(n > 0 for n in spec["proposed_per_block"]) >= 2
    assert all(0 <= n <= MAX_AUTO for n in spec["proposed_per_block"])
    assert len(spec["acceptance_by_position"]) == max(spec["proposed_per_block"])
