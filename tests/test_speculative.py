"""Speculative decoding (`lmtrace.generate(..., draft=...)`): the draft changes the speed, never
the numbers. Greedy: the same tokens as plain decoding and as transformers' model.generate, the
logprobs within 1e-4. Sampling: the acceptance rule is lossless (a chi-square test over 20,000
seeded draws), and the same test catches a raw q (transformers #47932)."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.errors import InvalidParameter
from lmtrace.logits import acceptance, sampling
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from tests.tiny import tiny_model
from tests.tiny_gguf import write_tiny_gguf

PROMPT = "Hello world, the quick"
GREEDY = {"max_new_tokens": 24, "temperature": 0, "top_logprobs": 3, "stop_on_eos": False}


@pytest.fixture(scope="module")
def other_lm(tiny_tok) -> LM:
    """A second tiny model with the same tokenizer (another seed): a draft that is often wrong."""
    return LM.from_objects(tiny_model(tiny_tok, seed=1), tiny_tok, source="tiny-seed-1")


@pytest.fixture(scope="module")
def gguf_lm(tmp_path_factory, tiny_tok) -> LM:
    """The tiny model written as a GGUF file (Q8_0 blocks) and loaded as float32: `packed` works."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", tiny_tok)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMTRACE_GGUF_CACHE", "0")
        return lmtrace.load(str(path), device="cpu", dtype="float32")


def _max_diff(a, b) -> float:
    pairs = [(s.logprob, t.logprob) for s, t in zip(a.steps, b.steps)]
    pairs += [(x.logprob, y.logprob) for s, t in zip(a.steps, b.steps) for x, y in zip(s.top, t.top)]
    return max(abs(x - y) for x, y in pairs)


def _hf_greedy(lm: LM, n: int) -> list[int]:
    ids = torch.tensor([lmtrace.encode_prompt(lm, PROMPT)])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n, pad_token_id=lm.pad_token_id, top_k=None, top_p=None)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("which", ["layers:1", "other", "self"])
def test_greedy_is_plain_decoding(tiny_lm, other_lm, which, k):
    draft = {"layers:1": "layers:1", "other": other_lm, "self": tiny_lm}[which]
    plain = lmtrace.generate(tiny_lm, PROMPT, **GREEDY)
    fast = lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft=draft, draft_tokens=k)
    assert fast.token_ids == plain.token_ids == _hf_greedy(tiny_lm, GREEDY["max_new_tokens"])
    assert fast.text == plain.text
    assert _max_diff(fast, plain) < 1e-4
    for s, t in zip(fast.steps, plain.steps):  # the cache as the contract says: prompt + i positions
        assert (s.kv["seq_len"], s.kv["bytes"], s.rank) == (t.kv["seq_len"], t.kv["bytes"], t.rank)
        assert [a.token_id for a in s.top] == [a.token_id for a in t.top]
    spec = fast.speculative
    assert spec["draft_tokens"] == k and len(spec["acceptance_by_position"]) == k
    accepted = sum(1 for s in fast.steps if s.draft and s.draft["accepted"])
    assert spec["target_forwards"] == 1 + spec["blocks"] == 1 + len(fast.steps) - accepted
    if which == "self":  # the target as its own draft: every proposal accepted
        assert spec["acceptance_by_position"] == [1.0] * k
        assert all(s.draft["accepted"] for s in fast.steps if s.draft is not None)


def test_greedy_with_a_penalty_and_packed_draft(gguf_lm):
    """`packed` on a GGUF target, with a repetition penalty: the penalty sees the block's
    proposals as the plain loop sees its tokens."""
    params = {**GREEDY, "repetition_penalty": 1.3}
    plain = lmtrace.generate(gguf_lm, PROMPT, **params)
    fast = lmtrace.generate(gguf_lm, PROMPT, **params, draft="packed", draft_tokens=3)
    assert fast.token_ids == plain.token_ids
    assert _max_diff(fast, plain) < 1e-4
    assert max(abs(s.sampled_logprob - t.sampled_logprob) for s, t in zip(fast.steps, plain.steps)) < 1e-4
    assert fast.speculative["draft_model"]["weights"] == "packed"
    assert fast.speculative["mean_accepted_per_block"] > 1  # 4-bit blocks of the same weights mostly agree


def test_steps_record_the_draft_and_the_crop(tiny_lm, other_lm):
    trace = lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft=other_lm, draft_tokens=3)
    d = trace.to_dict()
    assert all("draft" in s for s in d["steps"])  # null for a bonus token, written all the same
    rejected = [s for s in trace.steps if s.draft and not s.draft["accepted"]]
    assert rejected, "a draft of another seed is wrong somewhere"
    for s in rejected:  # the target's token in place of the proposal, the caches cropped
        assert s.token_id != s.draft["proposed_token_id"] and s.draft["accept_prob"] == 0.0
        crop = s.kv["crop"]["target"]
        assert crop["to"] == s.kv["seq_len"] and crop["from"] > crop["to"]
        assert crop["bytes_after"] < crop["bytes_before"]
    for s in trace.steps:
        if s.draft is not None:
            assert set(s.draft) >= {"proposed_token_id", "logprob", "target_logprob", "accept_prob", "accepted",
                                    "position", "text"}  # fmt: skip
            assert 0 <= s.draft["position"] < 3
    back = lmtrace.Trace.from_json(trace.to_json())
    assert back.to_dict() == d and back.speculative == trace.speculative


def test_sampled_run_is_seeded_and_measured_under_the_target(tiny_lm):
    """A sampled speculative run replays from its seed; every number is the target's: its
    processed logprob of each token equals teacher forcing of the whole text through the target."""
    params = {"max_new_tokens": 16, "temperature": 2.0, "top_k": 30, "top_p": 0.95, "seed": 7, "stop_on_eos": False}
    one = lmtrace.generate(tiny_lm, PROMPT, **params, draft="layers:1", draft_tokens=3)
    two = lmtrace.generate(tiny_lm, PROMPT, **params, draft="layers:1", draft_tokens=3)
    assert one.token_ids == two.token_ids and one.params["seed"] == 7
    verdicts = [s.draft["accepted"] for s in one.steps if s.draft is not None]
    assert any(verdicts) and not all(verdicts)
    ids = lmtrace.encode_prompt(tiny_lm, PROMPT) + one.token_ids
    with torch.inference_mode():
        logits = tiny_lm.model(torch.tensor([ids])).logits[0, -len(one.steps) - 1 : -1].float()
    processed = sampling.process_logits(logits, SamplingParams(**params), None)
    want = torch.log_softmax(processed, -1).gather(-1, torch.tensor(one.token_ids)[:, None])[:, 0]
    got = torch.tensor([s.sampled_logprob for s in one.steps])
    assert (got - want).abs().max() < 1e-4
    for s in one.steps:
        if s.draft is not None:
            ratio = min(1.0, float(torch.exp(torch.tensor(s.draft["target_logprob"] - s.draft["logprob"]))))
            assert abs(s.draft["accept_prob"] - ratio) < 1e-5


DRAWS = 20_000
# flat enough that the self-speculative draft (the first layer) and the target overlap: about half
# the proposals are accepted, and the raw q is far from the processed one
LOSSLESS = {"temperature": 2.0, "top_k": 30}


def _chi_square(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of the observed tokens against probabilities p;
    bins expected below 5 draws are pooled into one."""
    observed = torch.bincount(tokens, minlength=p.shape[0]).double()
    expected = p.double() * tokens.shape[0]
    assert observed[expected == 0].sum() == 0, "a token the target's processed distribution excludes"
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2))), dof


def _distributions(tiny_lm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target processed, draft processed, draft raw) logits (1, vocab) after the prompt; the
    draft is the target's first layer (`layers:1`)."""
    from lmtrace.model.draft import first_layers

    ids = torch.tensor([lmtrace.encode_prompt(tiny_lm, PROMPT)])
    with torch.inference_mode():
        target, draft = (m(ids).logits[:, -1].float() for m in (tiny_lm.model, first_layers(tiny_lm.model, 1)))
    params = SamplingParams(**LOSSLESS)
    return sampling.process_logits(target, params, None), sampling.process_logits(draft, params, None), draft


def test_sampling_is_lossless_and_the_test_has_power(tiny_lm):
    """20,000 proposals drawn from the draft's processed q, judged against the target's processed
    p: the emitted tokens follow p (chi-square passes). Judged with the raw q instead (the
    distribution transformers #47932 handed the rule), they do not (chi-square fails)."""
    p_logits, q_logits, q_raw = _distributions(tiny_lm)
    p = torch.softmax(p_logits, -1)[0]
    rng = torch.Generator().manual_seed(23)
    proposed = torch.multinomial(torch.softmax(q_logits, -1)[0], DRAWS, replacement=True, generator=rng)
    rows = lambda t: t.expand(DRAWS, -1)  # noqa: E731
    right = acceptance.judge(rows(p_logits), rows(q_logits), proposed, False, rng)
    stat, p_value, dof = _chi_square(right.tokens, p)
    rate = float(right.accepted.float().mean())
    print(f"\nlossless: chi2 = {stat:.1f}, dof = {dof}, p = {p_value:.3g}; accepted {rate:.3f}")
    assert p_value > 1e-3
    wrong = acceptance.judge(rows(p_logits), rows(q_raw), proposed, False, rng)
    stat_w, p_wrong, dof_w = _chi_square(wrong.tokens, p)
    print(f"raw q: chi2 = {stat_w:.1f}, dof = {dof_w}, p = {p_wrong:.3g}")
    assert p_wrong < 1e-6


def test_greedy_rule(tiny_lm):
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    v = acceptance.judge(logits, torch.tensor([[5.0, 0.0, 0.0]] * 2), torch.tensor([1, 0]), True, None)
    assert v.tokens.tolist() == [1, 1] and v.accepted.tolist() == [True, False]
    assert v.accept_prob.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("k", [0, 17, -1])
def test_draft_tokens_out_of_range(tiny_lm, k):
    with pytest.raises(InvalidParameter, match=rf"draft_tokens must be an integer in \[1, 16\] or .auto., got {k}"):
        lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft="layers:1", draft_tokens=k)


def test_bad_drafts(tiny_lm, tiny_dir):
    with pytest.raises(InvalidParameter, match="draft: 'packed' runs the target's own GGUF file"):
        lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft="packed")
    with pytest.raises(InvalidParameter, match=r"'layers:N' takes N in \[1, 1\] for this 2-layer model, got 2"):
        lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft="layers:2")
    with pytest.raises(InvalidParameter, match="layers:N"):
        lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft="layers:x")


@pytest.mark.parametrize("k", [1, 3])
def test_the_lens_and_the_attention_of_a_drafted_run_are_the_plain_runs(tiny_lm, k):
    """The verify forward keeps every position's captures: each accepted step's lens and attention
    are those of the plain run's step (within the speculative bound), the first block's first
    step the prefill's."""
    kw = {**GREEDY, "max_new_tokens": 10, "lens": True, "attention": "heads"}
    plain = lmtrace.generate(tiny_lm, PROMPT, **kw)
    drafted = lmtrace.generate(tiny_lm, PROMPT, **kw, draft="layers:1", draft_tokens=k)
    assert drafted.token_ids == plain.token_ids and drafted.speculative["blocks"] < len(plain.steps)
    for d, p in zip(drafted.steps, plain.steps):
        for a, b in zip(d.lens["layers"], p.lens["layers"]):
            assert [t["token_id"] for t in a["top"]] == [t["token_id"] for t in b["top"]]
            assert all(abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in zip(a["top"], b["top"]))
        for a, b in zip(d.attention["layers"], p.attention["layers"]):
            assert [t["position"] for t in a["top"]] == [t["position"] for t in b["top"]]
            assert all(abs(x["weight"] - y["weight"]) < 1e-5 for x, y in zip(a["top"], b["top"]))


@pytest.mark.parametrize("k", [1, 3])
def test_the_attribution_of_a_drafted_run_is_the_plain_runs(tiny_lm, k):
    """Each step's attribution reads its own position of the verify forward (the first block's
    first step the prefill's): the plain run's within the speculative bound, the lens beside it
    (whose own calls of the final norm after the forward are not the forward's)."""
    kw = {**GREEDY, "max_new_tokens": 10, "attribution": True, "against": "rank:3"}
    plain = lmtrace.generate(tiny_lm, PROMPT, **kw)
    for lens in (False, True):
        drafted = lmtrace.generate(tiny_lm, PROMPT, **kw, lens=lens, draft="layers:1", draft_tokens=k)
        assert drafted.token_ids == plain.token_ids and drafted.speculative["blocks"] < len(plain.steps)
        for d, p in zip(drafted.steps, plain.steps):
            a, b = d.attribution, p.attribution
            assert (a["token_id"], a["against_token_id"]) == (b["token_id"], b["against_token_id"])
            assert abs(a["logit_diff"] - b["logit_diff"]) < 1e-4
            assert [x["component"] for x in a["parts"]] == [x["component"] for x in b["parts"]]
            assert all(abs(x["value"] - y["value"]) < 1e-4 for x, y in zip(a["parts"], b["parts"]))
            assert all(abs(x["value"] - y["value"]) < 1e-4 for x, y in zip(a["heads"], b["heads"]))
            assert abs(sum(x["value"] for x in a["parts"]) - a["logit_diff"]) < 1e-4


def other_vocabulary_lm() -> LM:
    """A tiny model whose tokenizer was trained to another size: other ids for the same text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny import CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    other_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    return LM.from_objects(tiny_model(other_tok, seed=2), other_tok, source="other-vocab")


def test_another_vocabulary_is_refused(tiny_lm):
    with pytest.raises(InvalidParameter, match="draft: 'other-vocab' has another vocabulary than the target"):
        lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft=other_vocabulary_lm())


def test_stream_and_a_list_of_prompts(tiny_lm):
    plain = lmtrace.generate(tiny_lm, [PROMPT, "Once upon"], **GREEDY)
    fast = lmtrace.generate(tiny_lm, [PROMPT, "Once upon"], **GREEDY, draft="layers:1", draft_tokens=2)
    assert [t.token_ids for t in fast] == [t.token_ids for t in plain]
    assert all(t.speculative["draft"] == "layers:1" for t in fast)
    streamed = list(lmtrace.stream(tiny_lm, PROMPT, **GREEDY, draft="layers:1", draft_tokens=2))
    assert [s.token_id for s in streamed] == fast[0].token_ids


def test_stops_inside_a_block(tiny_lm):
    plain = lmtrace.generate(tiny_lm, PROMPT, **GREEDY)
    stop = plain.text[5:8]
    want = lmtrace.generate(tiny_lm, PROMPT, **{**GREEDY, "stop": [stop]})
    got = lmtrace.generate(tiny_lm, PROMPT, **{**GREEDY, "stop": [stop]}, draft=tiny_lm, draft_tokens=8)
    assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == "stop"
    short = lmtrace.generate(tiny_lm, PROMPT, **{**GREEDY, "max_new_tokens": 3}, draft=tiny_lm, draft_tokens=8)
    assert short.token_ids == plain.token_ids[:3]


def test_from_generate_on_assisted_generation(tiny_lm, other_lm):
    """model.generate(..., assistant_model=...): the target's numbers, as lmtrace's own speculative
    run gives them; the trace says the draft's are not in transformers' output."""
    ids = torch.tensor([lmtrace.encode_prompt(tiny_lm, PROMPT)])
    n = GREEDY["max_new_tokens"]
    out = tiny_lm.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=other_lm.model,
                                 do_sample=False, max_new_tokens=n, min_new_tokens=n, top_k=None, top_p=None,
                                 return_dict_in_generate=True, output_scores=True, output_logits=True,
                                 pad_token_id=tiny_lm.pad_token_id)  # fmt: skip
    [got] = lmtrace.from_generate(out, tiny_lm.tokenizer, model=tiny_lm.model, top_logprobs=3,
                                  assistant_model=other_lm.model)  # fmt: skip
    ours = lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft=other_lm, draft_tokens=4)
    assert got.token_ids == ours.token_ids
    assert _max_diff(got, ours) < 1e-4
    spec = got.speculative
    assert spec["draft"] == "assistant_model" and spec["proposals_recorded"] is False
    assert "not in it" in spec["note"] and spec["acceptance_by_position"] is None
    d = got.to_dict()
    assert all("draft" not in s for s in d["steps"]) and lmtrace.Trace.from_dict(d).speculative == spec


BUNDLED_PROMPT = "The three most important ideas in physics are"
BUNDLED_KW = {"max_new_tokens": 24, "temperature": 0, "top_logprobs": 5, "stop_on_eos": False}


@pytest.fixture(scope="module")
def bundled_plain(bundled_lm):
    """(plain decoding's trace, model.generate's new ids) of the bundled model on BUNDLED_PROMPT: the
    same for every draft below, so computed once for the three of them."""
    plain = lmtrace.generate(bundled_lm, BUNDLED_PROMPT, **BUNDLED_KW)
    ids = torch.tensor([lmtrace.encode_prompt(bundled_lm, BUNDLED_PROMPT)])
    n = BUNDLED_KW["max_new_tokens"]
    out = bundled_lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                    min_new_tokens=n, top_k=None, top_p=None,
                                    pad_token_id=bundled_lm.pad_token_id)  # fmt: skip
    return plain, out[0, ids.shape[1] :].tolist()


@pytest.mark.integration
@pytest.mark.parametrize("draft", ["packed", "layers:10", "bfloat16"])
def test_bundled_greedy_is_plain_decoding(bundled_lm, bundled_plain, draft):
    """The bundled model with its packed 4-bit draft, its first 10 layers, and a second model (its
    bfloat16 copy): the tokens of plain decoding and of model.generate, logprobs within 1e-4."""
    if draft == "bfloat16":
        draft = lmtrace.load(dtype="bfloat16")
    plain, generated = bundled_plain
    fast = lmtrace.generate(bundled_lm, BUNDLED_PROMPT, **BUNDLED_KW, draft=draft, draft_tokens=4)
    assert fast.token_ids == plain.token_ids == generated
    diff = _max_diff(fast, plain)
    rates = fast.speculative["acceptance_by_position"]
    print(f"\n{fast.speculative['draft']}: max |Δlogprob| {diff:.2e}, acceptance by position {rates}")
    assert diff < 1e-4


def test_compiled_draft(tiny_lm):
    """With `compile` the draft's one-token step runs torch.compile'd on a static cache (cropped by
    its fill mark): the same tokens, greedy and sampled, as the eager draft."""
    plain = lmtrace.generate(tiny_lm, PROMPT, **GREEDY)
    fast = lmtrace.generate(tiny_lm, PROMPT, **GREEDY, draft="layers:1", draft_tokens=3, compile=True)
    assert fast.token_ids == plain.token_ids and fast.params["compile"] is True
    crops = [s.kv["crop"]["draft"] for s in fast.steps if "draft" in s.kv.get("crop", {})]
    assert crops and all(c["bytes_after"] < c["bytes_before"] for c in crops)
    sampled = {"max_new_tokens": 12, "temperature": 2.0, "top_k": 30, "seed": 3, "stop_on_eos": False}
    one = lmtrace.generate(tiny_lm, PROMPT, **sampled, draft="layers:1", draft_tokens=3, compile=True)
    two = lmtrace.generate(tiny_lm, PROMPT, **sampled, draft="layers:1", draft_tokens=3)
    assert one.token_ids == two.token_ids
