"""Integration: constrained decoding on the bundled SmolLM2-135M-Instruct. Ten JSON schemas
(nested objects, arrays, enums, numbers, optional fields, a const) decoded together in one
continuous batch, each output valid under the `jsonschema` package and each step's allowed set
xgrammar's own; the constrained numbers against a hand-masked log-softmax of transformers'
cached logits; choice marginals against brute force; and vLLM's structured output (the vllm
extra) giving the same greedy tokens for the same schemas and prompts."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

import lmtrace
from lmtrace import SamplingParams
from lmtrace.decode import continuous, tracing
from lmtrace.decode.continuous import RowSpec
from tests.oracle import cached_logits, hf_processors
from tests.test_choices import exact
from tests.test_grammar import allowed_by_xgrammar, own_matcher
from tests.vllm_world import HAVE_VLLM

pytestmark = pytest.mark.integration


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required}


TEXT = {"type": "string", "maxLength": 20}
SCHEMAS = {
    "strings": (obj({"city": TEXT, "country": TEXT}), "Name the capital of France and its country as JSON."),
    "integer": (obj({"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
                "Describe a person called Alice who is 30 years old as JSON."),
    "enum": (obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}}),
             "Classify the sentiment of: I love this film! Answer in JSON."),
    "array": (obj({"colors": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1,
                              "maxItems": 3}}), "List three colours as JSON."),
    "nested": (obj({"book": obj({"title": {"type": "string", "maxLength": 30},
                                 "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})}),
               "Give a famous book with its title and year as JSON."),
    "number": (obj({"temperature_c": {"type": "number", "minimum": -50, "maximum": 60}}),
               "What is a typical summer temperature in Paris in Celsius? JSON."),
    "optional": (obj({"name": {"type": "string", "maxLength": 15}, "nickname": {"type": "string", "maxLength": 15}},
                     ["name"]), "Give a dog's name as JSON."),
    "boolean": (obj({"is_capital": {"type": "boolean"}, "city": {"enum": ["Paris", "Lyon"]}}),
                "Is Paris the capital of France? Answer in JSON."),
    "objects_in_array": (obj({"items": {"type": "array", "maxItems": 2, "items": obj({"name": {"type": "string",
                         "maxLength": 12}, "price": {"type": "integer", "minimum": 0, "maximum": 999}})}}),
                         "List two fruits with their price in cents as JSON."),
    "const": (obj({"kind": {"const": "answer"}, "value": {"type": "integer", "minimum": 0, "maximum": 10}}),
              "What is 2 + 2? Answer in JSON."),
}  # fmt: skip
MAX_TOKENS = 64


def test_ten_schemas_decoded_together_give_valid_json(bundled_lm):
    specs = [
        RowSpec(tracing.encode_prompt(bundled_lm, prompt, chat=True),
                SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS, json_schema=schema, top_logprobs=0), prompt,
                True)
        for schema, prompt in SCHEMAS.values()
    ]  # fmt: skip
    traces = continuous.generate_rows(bundled_lm, specs, max_batch=len(specs))
    vocab = bundled_lm.model.config.vocab_size
    for (name, (schema, _)), spec, trace in zip(SCHEMAS.items(), specs, traces):
        assert trace.finish_reason == "stop", (name, trace.text)
        jsonschema.validate(json.loads(trace.text), schema)
        matcher = own_matcher(bundled_lm, spec.params)
        for step in trace.steps:
            assert step.grammar["allowed"] == int(allowed_by_xgrammar(matcher, vocab).sum()), (name, step.index)
            assert matcher.accept_token(step.token_id)
        assert matcher.is_terminated()
        assert [f["path"] for f in trace.fields] and all(f["logprob"] <= 0 for f in trace.fields)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_constrained_numbers_equal_a_hand_masked_log_softmax(bundled_lm, sampled):
    schema, prompt = SCHEMAS["integer" if sampled else "boolean"]
    kw = {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 3} if sampled else {}
    params = SamplingParams(max_new_tokens=24, json_schema=schema, **({"temperature": 0} | kw))
    trace = lmtrace.generate(bundled_lm, prompt, params, chat=True)
    ids, tokens = trace.prompt["token_ids"], trace.token_ids
    logits = cached_logits(bundled_lm, ids, tokens)  # (steps, vocab)
    matcher, procs = own_matcher(bundled_lm, params), hf_processors(params)
    worst = 0.0
    for i, step in enumerate(trace.steps):
        allowed = allowed_by_xgrammar(matcher, logits.shape[-1])
        row = logits[i : i + 1]
        masked = row.masked_fill(~allowed, float("-inf"))
        processed = procs(torch.tensor([ids + tokens[:i]]), masked.clone())
        expected = [
            (step.grammar["logprob"], torch.log_softmax(masked, -1)[0, tokens[i]]),
            (step.grammar["removed_mass"], torch.softmax(row, -1)[0][~allowed].sum()),
            (step.sampled_logprob, torch.log_softmax(processed, -1)[0, tokens[i]]),
            (step.logprob, torch.log_softmax(row, -1)[0, tokens[i]]),
        ]
        worst = max([worst, *(abs(ours - float(theirs)) for ours, theirs in expected)])
        assert step.grammar["allowed"] == int(allowed.sum())
        assert matcher.accept_token(tokens[i])
    assert worst < 1e-5, worst


def test_choice_marginals_on_the_bundled_model(bundled_lm):
    options = ("yes", "no", "maybe")
    trace = lmtrace.generate(bundled_lm, "Is Paris in France? Answer yes, no or maybe.", chat=True, temperature=0,
                             max_new_tokens=8, choice=options)  # fmt: skip
    assert abs(sum(math.exp(c["logprob"]) for c in trace.choices) - 1) < 1e-4
    truth = exact(bundled_lm, trace.prompt["token_ids"], options)
    for c in trace.choices:
        p, n = truth[c["text"]]
        assert c["tokenizations"] == n and abs(math.exp(c["logprob"]) - p) < 1e-4, (c, p)


@pytest.mark.parametrize("name", ["strings", "enum", "integer", "objects_in_array"])
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'lmtrace[vllm]', see the README)")
@pytest.mark.vllm
def test_greedy_tokens_equal_vllm_structured_output(bundled_lm, vllm_structured, name):
    schema, prompt = SCHEMAS[name]
    theirs = vllm_structured(prompt, schema)
    ours = lmtrace.generate(bundled_lm, prompt, chat=True, temperature=0, max_new_tokens=MAX_TOKENS, json_schema=schema)
    assert ours.token_ids == theirs, (ours.text, bundled_lm.tokenizer.decode(theirs))


@pytest.fixture(scope="module")
def vllm_structured(bundled_lm, bundled_vllm):
    """vLLM on the bundled model (the session's engine, tests/conftest.py), its xgrammar backend
    compiling JSON compact as lmtrace does."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import StructuredOutputsParams

    engine = bundled_vllm

    def run(prompt: str, schema: dict) -> list[int]:
        ids = tracing.encode_prompt(bundled_lm, prompt, chat=True)
        params = VllmParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=bundled_lm.eos_token_ids,
                            structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
        (out,) = engine.llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)
        return list(out.outputs[0].token_ids)

    return run
