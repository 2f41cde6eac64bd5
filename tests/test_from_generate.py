"""lmtrace.external.from_generate: Traces of transformers' own model.generate runs, proven equal to
lmtrace.generate on the same model, prompt, seed and settings (transformers is the oracle)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import lmtrace
from lmtrace.model.lm import LM
from lmtrace.records import Trace

TOL = 1e-5
FLAGS = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}


def tiny_gpt2(tok) -> GPT2LMHeadModel:
    torch.manual_seed(1)
    special = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=4, **special)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)  # tied to the embeddings: spreads the logits
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval()


@pytest.fixture(scope="module")
def gpt2_lm(tiny_tok) -> LM:
    return LM.from_objects(tiny_gpt2(tiny_tok), tiny_tok, source="tiny-gpt2")


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= TOL


def assert_equal(got: Trace, want: Trace) -> None:
    """Token ids identical; logprob, sampled_logprob, rank, entropy and the alternatives within 1e-5."""
    assert got.token_ids == want.token_ids
    assert got.prompt["token_ids"] == want.prompt["token_ids"]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, want.finish_reason, want.stop_reason)
    for g, w in zip(got.steps, want.steps, strict=True):
        assert (g.text, g.bytes, g.rank) == (w.text, w.bytes, w.rank), g.index
        for name in ("logprob", "sampled_logprob", "entropy", "sampled_entropy"):
            assert _close(getattr(g, name), getattr(w, name)), (g.index, name, getattr(g, name), getattr(w, name))
        assert [a.token_id for a in g.top] == [a.token_id for a in w.top], g.index
        for a, b in zip(g.top, w.top):
            assert _close(a.logprob, b.logprob) and _close(a.sampled_logprob, b.sampled_logprob), g.index


def _hf_kwargs(settings: dict) -> dict:
    """generate's arguments for lmtrace's settings (top_k=0: transformers' own default is 50)."""
    t = settings.get("temperature", 1.0)
    if t == 0:
        return {"do_sample": False, "repetition_penalty": settings.get("repetition_penalty", 1.0)}
    keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    return {"do_sample": True, "top_k": 0, **{k: settings[k] for k in keys if k in settings}}


def run_both(lm: LM, prompt: str, settings: dict, seed: int = 0, n: int = 10) -> tuple[Trace, Trace]:
    ids = lm.tokenizer(prompt, return_tensors="pt")
    gen = {**_hf_kwargs(settings), "max_new_tokens": n}
    torch.manual_seed(seed)  # generate draws from the global generator; lmtrace from its own, seeded alike
    out = lm.model.generate(**ids, **gen, **FLAGS)
    [got] = lmtrace.from_generate(out, lm.tokenizer, model=lm.model, generation_config=gen, prompt=prompt)
    want = lmtrace.generate(lm, prompt, max_new_tokens=n, seed=seed, **settings)
    return got, want


SETTINGS = [
    {"temperature": 0},
    {"temperature": 0, "repetition_penalty": 1.3},
    {"temperature": 0.7},
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
    {"temperature": 1.3, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.2},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("seed", [0, 3])
def test_equal_to_lmtrace_on_tiny_llama(tiny_lm, settings, seed):
    got, want = run_both(tiny_lm, "Hello world, the", settings, seed)
    assert_equal(got, want)
    assert got.origin == "model.generate" and got.distributions == "both"
    assert want.origin == "lmtrace"
    assert got.params["temperature"] == want.params["temperature"]


@pytest.mark.parametrize("settings", SETTINGS[:4], ids=str)
def test_equal_to_lmtrace_on_tiny_gpt2(gpt2_lm, settings):
    got, want = run_both(gpt2_lm, "Once upon a time", settings, seed=5)
    assert_equal(got, want)
    assert got.model["config"]["architecture"] == "GPT2LMHeadModel"


def test_sampling_is_not_vacuous(tiny_lm):
    """The sampled runs above really sample: different seeds give different tokens, and the
    processed distribution differs from the raw one."""
    runs = [run_both(tiny_lm, "Hello world, the", {"temperature": 1.3}, seed)[0] for seed in (0, 1, 2)]
    assert len({tuple(t.token_ids) for t in runs}) > 1
    assert any(abs(s.logprob - s.sampled_logprob) > 1e-3 for s in runs[0].steps)
    assert any(s.rank > 1 for t in runs for s in t.steps)


def test_rescore_agrees(tiny_lm):
    got, _ = run_both(tiny_lm, "Hello world, the", {"temperature": 0.8, "top_k": 20}, seed=2)
    r = lmtrace.rescore(tiny_lm, got)
    assert r["max_abs_diff"] < 1e-4 and r["max_abs_diff_sampled"] < 1e-4 and r["rank_mismatches"] == 0


def _eos_lm(lm: LM, prompt: str, at: int) -> LM:
    """The same model with the token it greedily picks at step `at` as its end token, so rows end early."""
    first = lmtrace.generate(lm, prompt, max_new_tokens=at + 1, temperature=0)
    return dataclasses.replace(lm, eos_token_ids=[first.token_ids[at]])


def test_left_padded_batch_rows_ending_early(tiny_lm):
    prompts = ["Hello world, the quick brown fox", "很久", "Once upon a time"]
    lm = _eos_lm(tiny_lm, prompts[1], 2)
    eos = lm.eos_token_ids[0]
    tok = lm.tokenizer
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    gen = {"do_sample": False, "max_new_tokens": 12, "eos_token_id": eos}
    out = lm.model.generate(**batch, **gen, **FLAGS)
    got = lmtrace.from_generate(out, tok, model=lm.model, generation_config=gen, prompt=prompts)
    want = lmtrace.generate(lm, prompts, max_new_tokens=12, temperature=0)
    for g, w in zip(got, want, strict=True):
        assert_equal(g, w)
    assert got[1].finish_reason == "stop" and got[1].stop_reason == eos and len(got[1].steps) == 3
    assert len(got[1].steps) < out.sequences.shape[1] - batch["input_ids"].shape[1]  # pads after the end: no steps
    assert tok.pad_token_id not in got[1].prompt["token_ids"]


def test_num_return_sequences_sampling(tiny_lm):
    """rows x num_return_sequences traces, in generate's order; each equals lmtrace's loop fed the
    same expanded batch with the same seed."""
    prompts = ["Hello world", "Once upon a time there"]
    tok = tiny_lm.tokenizer
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    gen = {"do_sample": True, "temperature": 0.9, "top_k": 0, "max_new_tokens": 8, "num_return_sequences": 2}
    torch.manual_seed(7)
    out = tiny_lm.model.generate(**batch, **gen, **FLAGS)
    got = lmtrace.from_generate(out, tok, model=tiny_lm.model, generation_config=gen, prompt=prompts)
    assert len(got) == 4 and [g.prompt["text"] for g in got] == [prompts[0]] * 2 + [prompts[1]] * 2
    want = lmtrace.generate(tiny_lm, [prompts[0]] * 2 + [prompts[1]] * 2, max_new_tokens=8, temperature=0.9, seed=7)
    for g, w in zip(got, want, strict=True):
        assert_equal(g, w)
    assert got[0].token_ids != got[1].token_ids


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_beam_search_matches_compute_transition_scores(tiny_lm, penalty):
    prompts = ["Hello world, the quick", "很久很久"]
    lm = _eos_lm(tiny_lm, prompts[0], 3)
    tok = lm.tokenizer
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    gen = {"num_beams": 4, "num_return_sequences": 3, "do_sample": False, "max_new_tokens": 9,
           "repetition_penalty": penalty, "eos_token_id": lm.eos_token_ids[0], "length_penalty": 0.5}  # fmt: skip
    out = lm.model.generate(**batch, **gen, **FLAGS)
    traces = lmtrace.from_generate(out, tok, model=lm.model, generation_config=gen)
    assert len(traces) == 6
    oracle = lm.model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    width = batch["input_ids"].shape[1]
    for row, t in enumerate(traces):
        assert t.token_ids == out.sequences[row, width : width + len(t.steps)].tolist()
        steps = int((out.beam_indices[row] >= 0).sum())
        assert len(t.steps) == steps
        for i, s in enumerate(t.steps):
            assert abs(s.sampled_logprob - float(oracle[row, i])) <= TOL, (row, i)
            beam = int(out.beam_indices[row, i])
            raw = torch.log_softmax(out.logits[i][beam].float(), -1)
            assert abs(s.logprob - float(raw[s.token_id])) <= TOL
            assert s.rank == int((raw > raw[s.token_id]).sum()) + 1
    assert traces[0].params["num_beams"] == 4
    assert any(t.finish_reason == "stop" for t in traces) and any(len(t.steps) < 9 for t in traces)
    assert len({tuple(t.token_ids) for t in traces[:3]}) == 3  # three different beams


def _greedy_output(lm: LM, **flags):
    ids = lm.tokenizer("Hello world", return_tensors="pt")
    return lm.model.generate(**ids, do_sample=False, max_new_tokens=6, return_dict_in_generate=True, **flags)


def test_one_distribution_is_recorded_never_guessed(tiny_lm):
    both = lmtrace.from_generate(_greedy_output(tiny_lm, output_scores=True, output_logits=True), tiny_lm.tokenizer)[0]
    raw = lmtrace.from_generate(_greedy_output(tiny_lm, output_logits=True), tiny_lm.tokenizer)[0]
    processed = lmtrace.from_generate(_greedy_output(tiny_lm, output_scores=True), tiny_lm.tokenizer)[0]
    assert (raw.distributions, processed.distributions) == ("raw", "processed")
    for b, r, p in zip(both.steps, raw.steps, processed.steps, strict=True):
        assert (r.logprob, r.rank, r.entropy) == (b.logprob, b.rank, b.entropy)
        assert r.sampled_logprob is None and r.sampled_entropy is None
        assert all(a.sampled_logprob is None for a in r.top)
        assert p.sampled_logprob == b.sampled_logprob and p.sampled_entropy == b.sampled_entropy
        assert p.logprob is None and p.rank is None and p.entropy is None
        assert all(a.logprob is None and a.sampled_logprob is not None for a in p.top)
    for t in (raw, processed):  # the JSON round trip keeps unknown as unknown (not -inf)
        back = Trace.from_json(t.to_json())
        assert back.to_dict() == t.to_dict()
    assert raw.params["settings"] == "unknown"
    with pytest.raises(lmtrace.InvalidParameter, match="sampled=True"):
        processed.to_openai()
    assert processed.to_openai(sampled=True)["content"][0]["logprob"] == processed.steps[0].sampled_logprob


def test_older_traces_still_read(tiny_lm):
    d = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=3, temperature=0).to_dict()
    del d["origin"], d["distributions"]
    t = Trace.from_dict(d)
    assert (t.origin, t.distributions) == ("lmtrace", "both") and t.steps[0].sampled_logprob is not None


def test_final_kv_ledger(tiny_lm):
    out = _greedy_output(tiny_lm, output_scores=True)
    t = lmtrace.from_generate(out, tiny_lm.tokenizer, model=tiny_lm.model)[0]
    last = t.steps[-1].kv
    assert last["measured"] == "end"
    assert last["seq_len"] == len(t.prompt["token_ids"]) + len(t.steps) - 1
    assert last["bytes"] == last["expected_bytes"] and t.kv_anatomy["mismatches"] == []
    assert [len(layer["keys"]) for layer in last["layers"]] == [4, 4]
    assert all(s.kv == {} for s in t.steps[:-1])


def test_bad_input_is_one_clear_error(tiny_lm):
    tok = tiny_lm.tokenizer
    ids = tok("Hello", return_tensors="pt")
    plain = tiny_lm.model.generate(**ids, max_new_tokens=2, do_sample=False)
    with pytest.raises(lmtrace.InvalidParameter, match="return_dict_in_generate=True.*output_scores.*output_logits"):
        lmtrace.from_generate(plain, tok)
    bare = tiny_lm.model.generate(**ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(lmtrace.InvalidParameter, match="neither scores nor logits.*output_scores=.*output_logits="):
        lmtrace.from_generate(bare, tok)
    with pytest.raises(lmtrace.InvalidParameter, match="with .sequences.*got CausalLMOutputWithPast"):
        lmtrace.from_generate(tiny_lm.model(**ids), tok)
    with pytest.raises(lmtrace.InvalidParameter, match="got dict"):
        lmtrace.from_generate({"sequences": [[1, 2]]}, tok)
    good = _greedy_output(tiny_lm, output_scores=True)
    with pytest.raises(lmtrace.InvalidParameter, match="tokenizer: has 2000 tokens but the model's distributions have"):
        lmtrace.from_generate(good, other_vocab_tokenizer())
    with pytest.raises(lmtrace.InvalidParameter, match="top_logprobs"):
        lmtrace.from_generate(good, tok, top_logprobs=-1)


def other_vocab_tokenizer():
    """A tokenizer of another vocabulary size (2000 tokens), built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(2000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.integration
@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 0.7, "top_k": 40, "top_p": 0.95},
                                      {"temperature": 0, "repetition_penalty": 1.2}], ids=str)  # fmt: skip
def test_equal_to_lmtrace_on_bundled(bundled_lm, settings):
    got, want = run_both(bundled_lm, "The capital of France is", settings, seed=3, n=6)
    assert_equal(got, want)


def test_a_row_ended_by_a_stop_string_equals_lmtrace_generate(tiny_lm):
    """generate(stop_strings=...) ends a row at the token completing a stop string (pads after it
    while another row runs on): its trace keeps that token's text and is cut at the stop string,
    as lmtrace.generate's row with stop=... (it once lost the last token's text: read as an end token)."""
    prompts = ["Hello world, the quick brown fox", "Once upon a time"]
    plain = lmtrace.generate(tiny_lm, prompts[0], max_new_tokens=12, temperature=0)
    texts = [s.text for s in plain.steps]
    # a printable piece not seen before it (this tokenizer's pieces are mostly partial bytes)
    at = next(
        i
        for i in range(2, 12)
        if texts[i].isascii() and texts[i].isprintable() and texts[i].strip() and texts[i] not in "".join(texts[:i])
    )
    stop = texts[at]
    tok = tiny_lm.tokenizer
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    gen = {"do_sample": False, "max_new_tokens": 12, "stop_strings": [stop]}
    out = tiny_lm.model.generate(**batch, **gen, tokenizer=tok, **FLAGS)
    got = lmtrace.from_generate(out, tok, model=tiny_lm.model, generation_config=gen, prompt=prompts)
    want = lmtrace.generate(tiny_lm, prompts, max_new_tokens=12, temperature=0, stop=[stop])
    assert len(got[0].steps) == at + 1 and got[0].stop_reason == stop and got[0].finish_reason == "stop"
    assert got[0].text == "".join(texts[:at]) + texts[at][: texts[at].index(stop)]
    for g, w in zip(got, want, strict=True):
        assert_equal(g, w)
