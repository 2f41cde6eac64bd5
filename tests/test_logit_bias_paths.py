"""logit_bias meets the opt-in paths: the compiled static step and the batch-invariant mode each
take it (the biased token chosen at every greedy step, as on the default path), never drop it."""

from __future__ import annotations

import pytest

import lmtrace

TOKEN = 42


@pytest.mark.parametrize("path", ["default", "compile", "batch_invariant"])
def test_a_forced_token_is_chosen_on_every_path(tiny_lm, path):
    kw = {"compile": True} if path == "compile" else {}
    if path == "batch_invariant":
        with lmtrace.batch_invariant(tiny_lm.model):
            trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, logit_bias={TOKEN: 100})
    else:
        trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, logit_bias={TOKEN: 100}, **kw)
    assert list(trace.token_ids) == [TOKEN] * 4
    plain = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, logit_bias={TOKEN: 100})
    assert max(abs(a.logprob - b.logprob) for a, b in zip(trace.steps, plain.steps)) <= 5e-5


def test_the_compiled_step_keeps_each_bias_apart(tiny_lm):
    """Each compiled step shares one function's code with every other: a step compiled without a
    bias must not serve a request with one (bool() of a dict gave torch.compile no guard on it,
    so the bias was dropped after the first token), nor one bias another's."""
    kw = {"max_new_tokens": 4, "temperature": 0, "stop_on_eos": False, "compile": True}
    lmtrace.generate(tiny_lm, "Hello", **kw)
    for bias in ({TOKEN: 100}, {TOKEN: -100, TOKEN + 2: 100}):
        forced = max(bias, key=bias.get)
        assert list(lmtrace.generate(tiny_lm, "Hello", logit_bias=bias, **kw).token_ids) == [forced] * 4
