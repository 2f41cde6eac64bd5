"""tracing.generate_ids: prompts given as token ids, and stopping from on_step."""

from __future__ import annotations

import pytest

import lmtrace
from lmtrace.decode.tracing import generate_ids


def test_equals_generate_on_the_same_ids(tiny_lm):
    ref = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=6, temperature=0, top_logprobs=2)
    (trace,) = generate_ids(tiny_lm, [ref.prompt["token_ids"]], max_new_tokens=6, temperature=0, top_logprobs=2)
    assert trace.prompt == ref.prompt  # the text is decoded from the ids when not given
    assert [s.to_dict() | {"time_ms": 0} for s in trace.steps] == [s.to_dict() | {"time_ms": 0} for s in ref.steps]
    assert (trace.text, trace.finish_reason) == (ref.text, ref.finish_reason)


def test_an_exception_from_on_step_stops_the_generation(tiny_lm):
    seen = []

    def on_step(row, step):
        seen.append(step.index)
        if step.index == 2:
            raise KeyboardInterrupt  # anything: a server raises its own Cancelled

    ids = lmtrace.encode_prompt(tiny_lm, "Hello")
    with pytest.raises(KeyboardInterrupt):
        generate_ids(tiny_lm, [ids], max_new_tokens=50, temperature=0, on_step=on_step)
    assert seen == [0, 1, 2]
