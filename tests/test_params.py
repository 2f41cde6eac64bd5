from __future__ import annotations

import math

import pytest

from lmtrace import InvalidParameter, SamplingParams

BAD = [
    ("temperature", -0.1, "temperature must be >= 0, got -0.1"),
    ("temperature", math.nan, "temperature must be a finite number, got nan"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", math.inf, "top_p must be a finite number, got inf"),
    ("min_p", -0.5, "min_p must be in [0, 1], got -0.5"),
    ("min_p", 1.01, "min_p must be in [0, 1], got 1.01"),
    ("top_k", -1, "top_k must be >= 0, got -1"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
    ("repetition_penalty", -math.inf, "repetition_penalty must be a finite number, got -inf"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
    ("top_logprobs", 101, "top_logprobs must be in [0, 100], got 101"),
    ("top_logprobs", -1, "top_logprobs must be in [0, 100], got -1"),
    ("seed", -3, "seed must be >= 0, got -3"),
    ("seed", 2**64, "seed must be < 2**64, got 18446744073709551616"),
    ("max_new_tokens", 2.5, "max_new_tokens must be an integer, got 2.5"),
]


@pytest.mark.parametrize("name,value,message", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_bad_values_name_parameter_and_value(name, value, message):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**{name: value})
    assert str(e.value) == message


def test_defaults_and_round_trip():
    p = SamplingParams(stop="END", temperature=0)
    assert p.stop == ("END",) and p.greedy
    assert SamplingParams.from_dict(p.to_dict()) == p
