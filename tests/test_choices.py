"""`choice`: each option's exact probability under the constraint (lmtrace.decode.choices),
against an independent computation that uses neither xgrammar nor lmtrace's walk: every way to
cut the option's bytes into vocabulary tokens, each teacher-forced in one uncached forward, the
mask at each position written by hand (the tokens that keep the text a prefix of some option,
and the end token where the text is a whole option)."""

from __future__ import annotations

import math

import pytest
import torch

from lmtrace import SamplingParams
from lmtrace.decode import tracing
from lmtrace.detokenize import TokenBytes
from tests.same_record import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

# "wor" is a prefix of "world": after it the end token and more letters are both allowed
OPTIONS = ("the quick", "the lazy dog", "world", "wor", "很久")


def vocabulary(lm) -> dict[int, bytes]:
    special = set(lm.tokenizer.all_special_ids)
    tb = TokenBytes(lm.tokenizer)
    return {t: tb(t) for t in range(len(lm.tokenizer)) if t not in special}


def cuts(text: bytes, vocab: dict[int, bytes]) -> list[list[int]]:
    """Every sequence of tokens whose bytes join to `text`."""
    if not text:
        return [[]]
    return [[t, *rest] for t, b in vocab.items() if b and text.startswith(b) for rest in cuts(text[len(b) :], vocab)]


def hand_allowed(done: bytes, options: list[bytes], vocab: dict[int, bytes], eos: list[int]) -> list[int]:
    allowed = [t for t, b in vocab.items() if b and any(o.startswith(done + b) for o in options)]
    return allowed + (eos if done in options else [])


def exact(lm, prompt: list[int], options: tuple[str, ...]) -> dict[str, tuple[float, int]]:
    """{option: (probability, tokenizations)} by brute force."""
    vocab, coded = vocabulary(lm), [o.encode() for o in options]
    eos = lm.eos_token_ids
    out, allowed = {}, {}  # allowed: bytes so far -> the tokens allowed after them (the same for every path)
    for option, raw in zip(options, coded):
        total, paths = 0.0, cuts(raw, vocab)
        for path in paths:
            seq = torch.tensor([prompt + path])
            with torch.no_grad():
                logits = lm.model(seq).logits[0].float()  # (len, vocab)
            logp, done = 0.0, b""
            for i, token in enumerate([*path, eos[0]]):
                row = logits[len(prompt) + i - 1]
                keep = torch.full_like(row, float("-inf"))
                if done not in allowed:
                    allowed[done] = torch.tensor(hand_allowed(done, coded, vocab, eos))
                index = allowed[done]
                keep[index] = row[index]
                logp += float(torch.log_softmax(keep, -1)[token])
                done += vocab.get(token, b"")
            total += math.exp(logp)
        out[option] = (total, len(paths))
    return out


@pytest.mark.parametrize("prompt", ["Hello world", "Once upon a time"])
def test_choice_marginals_are_exact_and_sum_to_one(tiny_lm, prompt):
    trace = tracing.generate(tiny_lm, prompt, temperature=0, max_new_tokens=12, choice=OPTIONS)
    assert trace.text in OPTIONS
    found = {c["text"]: c for c in trace.choices}
    assert list(found) == list(OPTIONS)
    assert abs(sum(math.exp(c["logprob"]) for c in trace.choices) - 1) < 1e-4
    ids = tracing.encode_prompt(tiny_lm, prompt)
    for option, (p, n) in exact(tiny_lm, ids, OPTIONS).items():
        assert found[option]["tokenizations"] == n, option
        assert abs(math.exp(found[option]["logprob"]) - p) < 1e-5, option
    assert max(c["tokenizations"] for c in trace.choices) > 1  # the sum over tokenizations is tested


def test_choices_round_trip_through_json(tiny_lm):
    from lmtrace import Trace

    trace = tracing.generate(tiny_lm, "Hello", temperature=0, max_new_tokens=8, choice=("yes", "no"))
    again = Trace.from_json(trace.to_json())
    assert again.choices == trace.choices and again.to_dict() == trace.to_dict()


def test_the_sampled_option_follows_the_marginals(tiny_lm):
    """Sampling at temperature 1 without filters draws the options at their marginal rates."""
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=12, choice=("world", "wor", "the quick"))
              for s in range(60)]  # fmt: skip
    from lmtrace.decode import continuous
    from lmtrace.decode.continuous import RowSpec

    ids = tracing.encode_prompt(tiny_lm, "Hello")
    traces = continuous.generate_rows(tiny_lm, [RowSpec(ids, p, "Hello") for p in params], max_batch=16)
    rates = {o: sum(t.text == o for t in traces) / len(traces) for o in params[0].choice}
    for c in traces[0].choices:  # 60 draws: within 4 standard errors
        p = math.exp(c["logprob"])
        assert abs(rates[c["text"]] - p) <= 4 * math.sqrt(p * (1 - p) / len(traces)) + 1e-9, (c, rates)
