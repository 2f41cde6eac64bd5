"""Constrained decoding (lmtrace.logits.grammar through decode/step.py), checked against two
independent computations: xgrammar's own GrammarMatcher driven through the same tokens (the
allowed set at every step, read through xgrammar's own apply_token_bitmask_inplace), and a
hand-masked log-softmax of transformers' logits over the whole sequence (one uncached forward)
with transformers' own processors after the mask."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
import xgrammar as xgr

import lmtrace
from lmtrace import SamplingParams
from lmtrace.decode import continuous, tracing
from lmtrace.decode.continuous import RowSpec
from lmtrace.errors import InvalidParameter
from lmtrace.model.lm import LM
from tests.oracle import hf_processors
from tests.same_record import assert_same, one_thread  # noqa: F401
from tests.tiny import plain_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"],
}  # fmt: skip
CASES = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": r"[a-c]{2,4}-[0-9]{1,3}"},
    "choice": {"choice": ("the quick", "the lazy dog", "world")},
    "grammar": {"grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | [0-9]'},
}
SAMPLED = {"temperature": 0.8, "top_k": 30, "top_p": 0.95, "repetition_penalty": 1.2, "seed": 11}


@pytest.fixture(scope="module")
def nonbyte_lm() -> LM:
    tok = plain_tokenizer()
    return LM.from_objects(tiny_model(tok), tok, source="plain")


# tokenizer -> {(vocab size, stop ids): xgrammar's TokenizerInfo}: built once per tokenizer, as vLLM's
# backend builds it once per engine (on the bundled tokenizer ~0.3 s each time)
_INFOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def own_matcher(lm, params: SamplingParams) -> xgr.GrammarMatcher:
    """xgrammar's matcher built here, as vLLM's xgrammar backend builds it (not lmtrace's code)."""
    key = (lm.model.config.vocab_size, tuple(lm.eos_token_ids))
    infos = _INFOS.setdefault(lm.tokenizer, {})
    if key not in infos:
        infos[key] = xgr.TokenizerInfo.from_huggingface(lm.tokenizer, vocab_size=key[0], stop_token_ids=list(key[1]))
    info = infos[key]
    compiler = xgr.GrammarCompiler(info)
    if params.json_schema is not None:
        compiled = compiler.compile_json_schema(json.dumps(params.json_schema), any_whitespace=False,
                                                separators=(",", ":"))  # fmt: skip
    elif params.regex is not None:
        compiled = compiler.compile_regex(params.regex)
    elif params.choice:
        compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
    else:
        compiled = compiler.compile_grammar(params.grammar)
    return xgr.GrammarMatcher(compiled)


def allowed_by_xgrammar(matcher: xgr.GrammarMatcher, vocab: int) -> torch.Tensor:
    """(vocab,) bool through xgrammar's own bitmask application (-inf where not allowed)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    scores = torch.zeros((1, vocab))
    xgr.apply_token_bitmask_inplace(scores, bitmask)
    return torch.isfinite(scores[0])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_every_step_matches_xgrammar_and_a_hand_masked_log_softmax(tiny_lm, kind, sampled):
    params = SamplingParams(max_new_tokens=24, top_logprobs=3, **({"temperature": 0} | (SAMPLED if sampled else {})),
                            **CASES[kind])  # fmt: skip
    prompt = lmtrace.decode.tracing.encode_prompt(tiny_lm, "Hello world")
    trace = tracing.generate(tiny_lm, "Hello world", params)
    tokens = trace.token_ids
    vocab = tiny_lm.model.config.vocab_size
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = tiny_lm.model(seq).logits[0].float()  # (len, vocab), one uncached forward
    matcher = own_matcher(tiny_lm, params)
    procs = hf_processors(params)
    for i, step in enumerate(trace.steps):
        allowed = allowed_by_xgrammar(matcher, vocab)
        row = logits[len(prompt) + i - 1 : len(prompt) + i]  # (1, vocab)
        assert step.grammar["allowed"] == int(allowed.sum()), f"step {i}"
        masked = row.masked_fill(~allowed, float("-inf"))
        raw = torch.log_softmax(row, -1)[0]
        assert abs(step.grammar["removed_mass"] - float(raw.exp()[~allowed].sum())) < 1e-5
        assert abs(step.grammar["logprob"] - float(torch.log_softmax(masked, -1)[0, tokens[i]])) < 1e-5
        processed = procs(seq[:, : len(prompt) + i], masked.clone())  # the processors after the mask
        assert abs(step.sampled_logprob - float(torch.log_softmax(processed, -1)[0, tokens[i]])) < 1e-5
        assert abs(step.logprob - float(raw[tokens[i]])) < 1e-5
        assert matcher.accept_token(tokens[i])
    assert trace.finish_reason == "length" or matcher.is_terminated()


def test_the_mask_marks_every_step_of_the_engine(tiny_lm):
    """generate_steps: the engine's own (batch, vocab) mask is xgrammar's bitmask at each step."""
    params = SamplingParams(max_new_tokens=12, temperature=0, regex=r"[a-f]+ [0-9]+")
    prompt = tracing.encode_prompt(tiny_lm, "Once upon")
    matcher = own_matcher(tiny_lm, params)
    for step in tracing.generate_steps(tiny_lm, [prompt], params):
        assert torch.equal(step.allowed[0], allowed_by_xgrammar(matcher, tiny_lm.model.config.vocab_size))
        assert matcher.accept_token(step.token_ids[0])


def test_an_unconstrained_trace_has_no_grammar_fields(tiny_lm):
    d = tracing.generate(tiny_lm, "Hello", temperature=0, max_new_tokens=3).to_dict()
    assert not {"fields", "choices"} & d.keys() and all("grammar" not in s for s in d["steps"])
    assert not {"json_schema", "regex", "choice", "grammar", "json_whitespace"} & d["params"].keys()


def test_the_waterfall_has_a_grammar_stage_first(tiny_lm):
    trace = tracing.generate(tiny_lm, "Hello", temperature=0.9, seed=2, top_k=10, max_new_tokens=4, waterfall="all",
                             regex=r"[a-z]{4}")  # fmt: skip
    for step in trace.steps:
        stages = {s["stage"]: s for s in step.waterfall}
        assert [s["stage"] for s in step.waterfall][:2] == ["raw", "grammar"]
        assert stages["grammar"]["allowed"] == step.grammar["allowed"]
        assert abs(stages["grammar"]["removed_mass"] - step.grammar["removed_mass"]) < 1e-6
        assert abs(step.waterfall[-1]["chosen_prob"] - torch.tensor(step.sampled_logprob).exp().item()) < 1e-5


def test_rows_with_different_grammars_and_none_decode_together_as_alone(tiny_lm):
    prompts = ["Hello world", "Once upon a time", "The cat", "很久很久以前，", "A B"]
    settings = [{**CASES["json_schema"], "temperature": 0}, {**CASES["regex"], **SAMPLED},
                {**CASES["choice"], "temperature": 0}, {"temperature": 0}, {**CASES["grammar"], "temperature": 0}]
    params = [SamplingParams(max_new_tokens=16, **kw) for kw in settings]
    specs = [RowSpec(tracing.encode_prompt(tiny_lm, t), p, t) for t, p in zip(prompts, params)]
    together = continuous.generate_rows(tiny_lm, specs, max_batch=3)  # rows join as others leave
    for text, p, trace in zip(prompts, params, together):
        alone = tracing.generate(tiny_lm, text, p)
        assert trace.token_ids == alone.token_ids, text
        assert_same(trace.to_dict(), alone.to_dict(), tol=5e-5)


def test_a_grammar_that_allows_nothing_is_bad_input(nonbyte_lm):
    """A vocabulary without "Q" (no byte fallback): the regex can never start."""
    with pytest.raises(InvalidParameter, match=r"^regex: the grammar allows no token at step 0"):
        tracing.generate(nonbyte_lm, "the", regex="Q+", max_new_tokens=4)
    row = RowSpec(tracing.encode_prompt(nonbyte_lm, "the"), SamplingParams(regex="Q+", max_new_tokens=4), "the")
    ok = RowSpec(tracing.encode_prompt(nonbyte_lm, "the"), SamplingParams(temperature=0, max_new_tokens=4), "the")
    batch = continuous.ContinuousBatch(nonbyte_lm, 4)
    bad, good = batch.join_many([row, ok])
    while not batch.empty:
        batch.step()
    assert isinstance(bad.error, InvalidParameter) and good.error is None and len(good.trace.steps) == 4


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"json_schema": {"type": "foo"}}, r"^json_schema does not compile \(Unsupported type \"foo\"\)"),
        ({"json_schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
         r"^json_schema: uniqueItems at # is not supported"),
        ({"json_schema": {"type": "object", "properties": {"not": {"type": "string", "format": "color"}}}},
         r"^json_schema: format 'color' at #/properties/not"),
        ({"regex": "(ab"}, r"^regex does not compile \(Regex parsing error at position \d+: The parenthesis"),
        ({"grammar": "root ::= item"}, r"^grammar does not compile \(EBNF parser error .*Rule \"item\" is not defined"),
    ],
)  # fmt: skip
def test_a_constraint_that_does_not_compile_names_its_parameter(kw, message):
    from lmtrace.logits import grammar

    with pytest.raises(InvalidParameter, match=message):
        grammar.check(SamplingParams(**kw))


def test_branches_decode_under_the_grammar(tiny_lm):
    """Every branch decodes under the constraint, the alternatives ranked among the tokens it
    allows at the step; a rank past them is refused in one line."""
    from lmtrace.decode import constrained
    from lmtrace.decode.branch import branch

    kw = {"regex": r"[a-c]{2,4}-[0-9]{1,3}", "max_new_tokens": 10, "temperature": 0}
    result = branch(tiny_lm, "Hi", 1, [2, 3], **kw)
    original, *branches = result.traces
    assert original.token_ids == lmtrace.generate(tiny_lm, "Hi", **kw).token_ids
    for trace in result.traces:
        (matcher,) = constrained.matchers(tiny_lm, [SamplingParams(**kw)])
        assert all(matcher.done or matcher.accept(t) for t in trace.token_ids)
        assert all(s.grammar is not None for s in trace.steps)
    assert [b.token_ids[1] for b in branches] != [original.token_ids[1]] * 2
    with pytest.raises(InvalidParameter, match="^alternative: the constraint allows 1 tokens at step 0, got rank 2$"):
        branch(tiny_lm, "Hi", 0, regex="a+", max_new_tokens=2)


def test_the_vllm_engine_refuses_a_constraint():
    from lmtrace.vllm.params import to_vllm

    with pytest.raises(ValueError, match="^choice: --engine vllm does not trace constrained decoding"):
        to_vllm(SamplingParams(choice=("a", "b")), [0])
