"""lmtrace.stops: the one stop-string holder (a row's record and the server's stream both use it)
and the one finish-reason rule. The expected values are those the two scans it replaced (the
row's in decode/row_state.py, the stream's in server/sse.py) gave; the property test holds the
incremental scan to the rule written out over the whole text."""

from __future__ import annotations

import random

import pytest

from lmtrace.decode.row_state import RowState
from lmtrace.params import SamplingParams
from lmtrace.records import Step
from lmtrace.server.sse import ChoiceStream
from lmtrace.stops import StopStrings, finish_reason


def step(text: str, token_id: int = 1) -> Step:
    return Step(0, token_id, text, list(text.encode()), -1.0, -1.0, 1, 0.0, 0.0, [], {}, 0.0)


def fed(stops: list[str], pieces: list[str]) -> tuple[StopStrings, list[bool], list[str]]:
    """The holder after `pieces`, with what each `feed` answered and what each `release` gave."""
    held, hits, released = StopStrings(stops), [], []
    for p in pieces:
        hits.append(held.feed(p))
        released.append(held.release())
    return held, hits, released


def test_a_stop_string_split_across_pieces_is_held_then_cut():
    held, hits, released = fed(["ab"], ["xa", "bc"])
    assert hits == [False, True] and (held.cut, held.stop) == (1, "ab")
    assert released == ["x", ""]


def test_a_held_tail_goes_out_once_the_stop_string_does_not_follow():
    _, hits, released = fed(["abc"], ["x", "a", "b", "d"])
    assert hits == [False] * 4 and released == ["x", "", "", "abd"]


def test_the_stop_string_completed_first_wins_over_an_overlapping_longer_one():
    held, hits, _ = fed(["bcd", "abc"], ["a", "b", "c", "d"])
    assert hits == [False, False, True, True] and (held.cut, held.stop) == (0, "abc")


def test_overlapping_stops_completed_by_one_piece_cut_at_the_earliest():
    held, _, _ = fed(["bc", "abc"], ["xabc"])
    assert (held.cut, held.stop) == (1, "abc")
    held, _, _ = fed(["abc", "ab"], ["abc"])  # one position: the smaller string
    assert (held.cut, held.stop) == (0, "ab")


def test_a_stop_at_the_very_first_piece_releases_nothing():
    held, hits, released = fed(["He"], ["Hello"])
    assert hits == [True] and held.cut == 0 and released == [""]


def test_nothing_is_held_without_stop_strings():
    held, hits, released = fed([], ["a", "", "好"])
    assert hits == [False] * 3 and released == ["a", "", "好"] and held.cut is None


def brute(stops: list[str], pieces: list[str]) -> tuple[int | None, tuple[int, str] | None]:
    """The rule over the whole text after each piece: the first piece after which some stop string
    occurs, and the earliest occurrence then (ties to the smaller string)."""
    text = ""
    for i, p in enumerate(pieces):
        text += p
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            return i, min(found)
    return None, None


@pytest.mark.parametrize("seed", range(4))
def test_the_incremental_scan_equals_the_rule_over_the_whole_text(seed):
    rng = random.Random(seed)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        pieces = ["".join(rng.choice("ab c好") for _ in range(rng.choice([0, 1, 1, 2, 4]))) for _ in range(8)]
        held, sent = StopStrings(stops), ""
        at, expected = brute(stops, pieces)
        for i, p in enumerate(pieces[: None if at is None else at + 1]):
            assert held.feed(p) == (i == at)
            sent += held.release()
            assert at is None or len(sent) <= expected[0]  # never text that a stop string then cuts
        assert (None if held.cut is None else (held.cut, held.stop)) == expected
        if held.cut is not None:
            assert sent == held.text[: held.cut]
        else:  # held back: exactly the longest tail that begins a stop string
            rest = held.text[len(sent) :]
            assert rest == "" or any(s.startswith(rest) for s in stops)
            assert all(not any(s.startswith(held.text[j:]) for s in stops) for j in range(len(sent)))


def test_a_character_the_detokenizer_holds_back_completes_the_stop_string(tiny_lm):
    """ "ab好c" on the byte-level tokenizer: 好 is three tokens, two of them with empty pieces."""
    ids = tiny_lm.tokenizer.encode("ab好c", add_special_tokens=False)
    record, stream, hits, deltas = RowState(tiny_lm, SamplingParams(stop=["好c"])), ChoiceStream(["好c"]), [], []
    for i, token in enumerate(ids):
        hits.append(record.add(token, False))
        piece = record.closing(finish_reason(False, hits[-1], i == len(ids) - 1), token)
        deltas.append(stream.add(step(piece, token), False)[0])
    assert record.detok.emitted == "ab好c"
    assert hits == [False] * (len(ids) - 1) + [True]
    assert (record.held.cut, record.stop_reason) == (2, "好c")
    assert deltas == ["a", "b", "", "", "", ""]
    assert stream.finish("ab")[0] == ""


def test_the_end_token_is_no_text_to_scan(tiny_lm):
    eos = tiny_lm.tokenizer.eos_token_id
    ids = tiny_lm.tokenizer.encode("ab", add_special_tokens=False) + [eos]
    record = RowState(tiny_lm, SamplingParams(stop=["b<"]))
    assert [record.add(t, t == eos) for t in ids] == [False, False, False]
    assert record.held.cut is None and record.text_before_eos == "ab"


@pytest.mark.parametrize(
    ("is_eos", "hit_stop", "last", "step", "trace"),
    [
        (True, False, False, "eos", "stop"),
        (True, True, True, "eos", "stop"),
        (False, True, False, "stop", "stop"),
        (False, True, True, "stop", "stop"),
        (False, False, True, "length", "length"),
        (False, False, False, None, "stop"),  # a trace that ended short of its length
    ],
)
def test_finish_reason_of_a_step_and_of_a_trace(is_eos, hit_stop, last, step, trace):
    assert finish_reason(is_eos, hit_stop, last) == step
    assert finish_reason(is_eos, hit_stop, last, openai=True) == trace
