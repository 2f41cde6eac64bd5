"""logit_bias as a processor (OpenAI's: {token id: bias in [-100, 100]} added to the logits before
every other stage): the fold against transformers' SequenceBiasLogitsProcessor, greedy decoding
under it, its stage in the waterfall (listed only where given), the record's round trip, the
library's and the CLI's spelling, and bad input named."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

import lmtrace
from lmtrace.cli import main
from lmtrace.errors import InvalidParameter
from lmtrace.logits import processors
from lmtrace.params import SamplingParams
from lmtrace.vllm.params import process_like_vllm

BIAS = {7: 4.0, 11: -2.5, 40: 100.0, 41: -100.0}


def test_the_bias_is_transformers_sequence_bias_applied_first():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 60, generator=gen) * 3
    ids = torch.randint(0, 60, (2, 9), generator=gen)
    seen = torch.zeros(2, 60, dtype=torch.bool).scatter(1, ids, True)
    p = SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias=BIAS)
    theirs = SequenceBiasLogitsProcessor({(t,): b for t, b in BIAS.items()})(ids, logits.clone())
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids, theirs)  # transformers' order: the bias first
    ours = processors.process(logits, p, seen)
    assert torch.equal(ours, theirs)
    assert torch.equal(process_like_vllm(logits, p, seen), theirs)  # vLLM's order starts with it too
    plain = SamplingParams(temperature=0.7, top_k=5)
    assert [s[0] for s in processors.scan(logits, plain, None)] == [n for n in processors.ORDER if n != "logit_bias"]
    assert processors.scan(logits, SamplingParams(logit_bias=BIAS), None)[0][:3] == (
        "logit_bias", {str(k): v for k, v in BIAS.items()}, True)  # fmt: skip


def test_greedy_under_the_bias_and_its_waterfall_stage(tiny_lm):
    alone = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=6, temperature=0)
    pinned = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=6, temperature=0, logit_bias={"50": 100},
                              waterfall="all")  # fmt: skip
    assert pinned.token_ids == [50] * 6 and alone.token_ids != pinned.token_ids
    banned = alone.token_ids[0]
    without = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=6, temperature=0, logit_bias={banned: -100})
    assert banned not in without.token_ids
    for step in pinned.steps:
        stages = {s["stage"]: s for s in step.waterfall}
        assert list(stages)[:3] == ["raw", "logit_bias", "repetition_penalty"]
        assert stages["logit_bias"]["setting"] == {"50": 100.0} and stages["logit_bias"]["applied"]
        assert stages["logit_bias"]["chosen_rank"] == 1 and stages["raw"]["chosen_rank"] == step.rank
        # raw stays the model's own; the processed number is after the bias
        assert stages["logit_bias"]["chosen_prob"] == pytest.approx(math.exp(step.sampled_logprob), abs=1e-6)
        assert step.rank > 1 and step.sampled_logprob > step.logprob
    assert pinned.params["logit_bias"] == {"50": 100.0}
    assert lmtrace.Trace.from_json(pinned.to_json()) == pinned
    assert all(len(s.waterfall) == 6 for s in lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, waterfall="all").steps)


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"x": 1}, "logit_bias: key 'x' is not a token id (a non-negative integer)"),
        ({"05": 1}, "logit_bias: key '05' is not a token id (a non-negative integer)"),
        ({-3: 1}, "logit_bias: key -3 is not a token id (a non-negative integer)"),
        ({3: 100.5}, "logit_bias: the bias of token 3 must be in [-100, 100], got 100.5"),
        ({3: math.nan}, "logit_bias: the bias of token 3 must be a finite number, got nan"),
        ({3: "high"}, "logit_bias: the bias of token 3 must be a number, got 'high'"),
        ([3, 1], "logit_bias must be an object of token id -> bias, got [3, 1]"),
    ],
)
def test_bad_biases_are_named(bias, message):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(logit_bias=bias)
    assert str(e.value) == message


def test_an_id_outside_the_vocabulary(tiny_lm):
    with pytest.raises(InvalidParameter, match=r"^logit_bias: token id 300 is not in the vocabulary \(300 tokens"):
        lmtrace.generate(tiny_lm, "Hello", max_new_tokens=2, logit_bias={300: 1})


def test_the_cli_takes_logit_bias(capsys, tiny_dir):
    args = ["generate", "Hello world", "--model", str(tiny_dir), "--max-new-tokens", "3", "--temperature", "0"]
    assert main([*args, "--logit-bias", "50=100", "--logit-bias", "51=-1.5", "--json", "-"]) == 0
    trace = json.loads(capsys.readouterr().out)
    assert [s["token_id"] for s in trace["steps"]] == [50, 50, 50]
    assert trace["params"]["logit_bias"] == {"50": 100.0, "51": -1.5}
    for bad, message in (("50", "logit-bias must be ID=BIAS (a token id and a number), got '50'"),
                         ("50=200", "logit_bias: the bias of token 50 must be in [-100, 100], got 200.0")):  # fmt: skip
        assert main([*args, "--logit-bias", bad]) == 2
        assert capsys.readouterr().err.strip() == f"lmtrace: error: {message}"
