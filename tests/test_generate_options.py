"""GenerateOptions (decode/options.py): the options of a generation as one object, passed whole
or as keyword arguments to generate, stream and generate_ids, with the same records; the
refusals in one line."""

from __future__ import annotations

import pytest

import lmtrace
from lmtrace.decode import tracing
from tests.composability import comparable

BASE = {"max_new_tokens": 5, "temperature": 0, "top_logprobs": 3}


def test_options_whole_equal_keywords(tiny_lm):
    kw = {**BASE, "echo": True, "waterfall": 1, "lens": True}
    by_keywords = lmtrace.generate(tiny_lm, "Once upon", **kw).to_dict()
    options = lmtrace.GenerateOptions.of(None, **kw)
    assert options.echo and options.waterfall == 1 and options.lens and options.params.max_new_tokens == 5
    whole = lmtrace.generate(tiny_lm, "Once upon", options=options).to_dict()
    assert comparable(whole) == comparable(by_keywords)
    assert whole["prompt_logprobs"] and whole["steps"][1]["waterfall"] and whole["steps"][0]["lens"]


def test_generate_ids_takes_every_option_generate_takes(tiny_lm):
    """generate_ids once took lens, attention, draft, observers and processors only: now the
    same options as generate (echo and the waterfall here), with the same records."""
    ref = lmtrace.generate(tiny_lm, "Once upon", echo=True, waterfall="all", **BASE)
    (got,) = tracing.generate_ids(
        tiny_lm, [ref.prompt["token_ids"]], prompt_texts=["Once upon"], echo=True, waterfall="all", **BASE
    )
    assert comparable(got.to_dict()) == comparable(ref.to_dict())


def test_stream_with_options_equals_generate(tiny_lm):
    options = lmtrace.GenerateOptions(lmtrace.SamplingParams(**BASE), waterfall="all")
    streamed = [s.to_dict() for s in lmtrace.stream(tiny_lm, "Once upon", options=options)]
    traced = lmtrace.generate(tiny_lm, "Once upon", options=options).to_dict()["steps"]
    assert comparable(streamed) == comparable(traced)


def test_refusals_name_the_option(tiny_lm):
    with pytest.raises(lmtrace.InvalidParameter, match="^echo: stream does not take echo$"):
        list(lmtrace.stream(tiny_lm, "Hi", options=lmtrace.GenerateOptions(echo=True)))
    with pytest.raises(lmtrace.InvalidParameter, match="^echo: stream does not take echo$"):
        list(lmtrace.stream(tiny_lm, "Hi", echo=True))
    with pytest.raises(lmtrace.InvalidParameter, match="^colour: generate does not take colour$"):
        lmtrace.generate(tiny_lm, "Hi", colour=True)
    with pytest.raises(lmtrace.InvalidParameter, match=r"^options: generate takes options whole .*\(got lens\)$"):
        lmtrace.generate(tiny_lm, "Hi", options=lmtrace.GenerateOptions(), lens=True)
    with pytest.raises(lmtrace.InvalidParameter, match="^draft: generate_each does not take draft$"):
        tracing.generate_each(tiny_lm, ["Hi"], [[1, 2]], [lmtrace.SamplingParams()], draft="layers:1")
