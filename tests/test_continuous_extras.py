"""Echo, the waterfall, the attribution and the user's processors per row of a continuous batch:
each row's record is the one generate gives it alone (ids identical, numbers within the batched
bound), rows at different steps and rows that join while others decode (in their forward) too,
beside rows that asked for nothing."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.decode import attribution as attributing
from lmtrace.decode import tracing
from lmtrace.decode.continuous import RowSpec, generate_rows
from lmtrace.decode.observers import build
from lmtrace.errors import GenerationError
from lmtrace.logits.processors import UserProcessor
from tests.composability import BATCHED_TOL, comparable, differences, no_top_token
from tests.same_record import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Hello world", "Once upon a time there was", "The quick brown fox", "很久很久以前，"]


def row(lm, prompt: str, **options) -> tuple[RowSpec, dict]:
    """A row asking for generate's `options`, and generate's own record of the same work."""
    kw = {"max_new_tokens": 5, "temperature": 0, "top_logprobs": 3, **options}
    alone = lmtrace.generate(lm, prompt, **kw).to_dict()
    params = lmtrace.SamplingParams(**{k: v for k, v in kw.items() if k in lmtrace.SamplingParams.__dataclass_fields__})
    observers = build(waterfall=kw.get("waterfall"), max_new_tokens=params.max_new_tokens, top_n=params.top_logprobs)
    observers += attributing.wanted(lm, kw.get("attribution", False), kw.get("against"))
    user = tuple(UserProcessor(fn, fn.__name__) for fn in kw.get("logits_processors", ()))
    ids = tracing.encode_prompt(lm, prompt)
    spec = RowSpec(ids, params, prompt, observers=observers, echo=kw.get("echo", False), logits_processors=user)
    return spec, alone


def same(got: dict, alone: dict) -> None:
    assert got["token_ids"] == alone["token_ids"]
    found = differences(comparable(got), comparable(alone), BATCHED_TOL)
    assert not found, found[:4]


@pytest.mark.parametrize("max_batch", [2, 4], ids=["joining", "together"])
def test_each_row_records_what_it_asked_for_as_alone(tiny_lm, max_batch):
    """With room for 2, the last two rows join as the first ones leave: in the running batch's
    forward (echo measured there too) or with a prefill of their own (the attribution's hooks)."""
    asked = [
        {"max_new_tokens": 2},
        {"waterfall": "all", "logits_processors": [no_top_token], "max_new_tokens": 7},
        {"echo": True, "max_new_tokens": 4},
        {"attribution": True, "max_new_tokens": 3},
    ]
    pairs = [row(tiny_lm, p, **a) for p, a in zip(PROMPTS, asked)]
    traces = generate_rows(tiny_lm, [s for s, _ in pairs], max_batch=max_batch)
    for trace, (_, alone) in zip(traces, pairs):
        same(trace.to_dict(), alone)
    assert traces[1].params["logits_processors"] == ["no_top_token"]
    assert all(s.waterfall is not None for s in traces[1].steps) and traces[0].steps[0].waterfall is None
    assert traces[2].prompt_logprobs is not None and traces[0].prompt_logprobs is None
    assert "attribution" in traces[3].steps[0].entries and "attribution" not in traces[0].steps[0].entries


def test_a_waterfall_at_one_step_is_the_rows_own_step(tiny_lm):
    """Rows at different steps: `waterfall` 2 is each row's own third step."""
    first, a = row(tiny_lm, PROMPTS[1], max_new_tokens=3)
    late, b = row(tiny_lm, PROMPTS[0], waterfall=2, max_new_tokens=6)
    plain, c = row(tiny_lm, PROMPTS[2], max_new_tokens=8)
    traces = generate_rows(tiny_lm, [first, plain, late], max_batch=2)
    for trace, alone in zip(traces, (a, c, b)):
        same(trace.to_dict(), alone)
    assert [s.waterfall is not None for s in traces[2].steps] == [False, False, True, False, False, False]


def test_a_sampled_row_with_a_processor_draws_as_alone(tiny_lm):
    spec, alone = row(tiny_lm, PROMPTS[0], temperature=0.8, seed=3, logits_processors=[no_top_token])
    other, plain = row(tiny_lm, PROMPTS[1], temperature=0.8, seed=4)
    for trace, ref in zip(generate_rows(tiny_lm, [spec, other], max_batch=2), (alone, plain)):
        same(trace.to_dict(), ref)


def test_a_processor_that_leaves_nothing_names_itself(tiny_lm):
    def nothing(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return torch.full_like(logits, float("-inf"))

    spec, _ = row(tiny_lm, PROMPTS[0])
    spec.logits_processors = (UserProcessor(nothing, "nothing"),)
    with pytest.raises(GenerationError, match="logits_processors: nothing left no token"):
        generate_rows(tiny_lm, [spec], max_batch=1)
