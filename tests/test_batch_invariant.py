"""The batch-invariant mode (lmtrace.model.invariant), modelled on vLLM's
tests/v1/determinism/test_batch_invariance.py: a needle prompt alone, then at a random position
among random prompts of 5-400 tokens in batches of 2-16, greedy and seeded T 0.7 with top-5
logprobs: token ids, every logprob, entropy and alternative `==`. Plus: teacher forcing equals
the decoded steps, the invariant numbers stay the model's (within 5e-5 of the default path), a
plain transformers model under `lmtrace.batch_invariant` (gradients on, right-padded) gives the
same bits, and what cannot be invariant is refused in one line."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

import lmtrace
from lmtrace.errors import InvalidParameter
from lmtrace.model.invariant import mode
from lmtrace.model.lm import LM
from tests.tiny import tiny_config

WORDS = ["the", "cat", "sat", "on", "a", "blue", "mat", "and", "dog", "ran", "far", "over", "hills", ","]


def numbers(trace) -> list:
    """Everything a request gets per step but its timing and cache shape."""
    return [(s.token_id, s.logprob, s.sampled_logprob, s.rank, s.entropy, s.sampled_entropy,
             [(a.token_id, a.logprob, a.sampled_logprob) for a in s.top]) for s in trace.steps]  # fmt: skip


@pytest.fixture(scope="module")
def long_tiny(tiny_tok) -> LM:
    """The tiny Llama (GQA, random init) with room for 400-token prompts, switched invariant."""
    torch.manual_seed(3)
    config = tiny_config(len(tiny_tok), tiny_tok.eos_token_id, tiny_tok.pad_token_id)
    config.max_position_embeddings = 512
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    mode.install(model)
    return LM.from_objects(model, tiny_tok, source="tiny-long")


def text(rng: random.Random, tokens: int, tokenizer) -> str:
    """Random words, about `tokens` tokens long (at least that many, a word more at most)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(max(1, (tokens - len(tokenizer.encode(" ".join(words)))) // 3))]
    return " ".join(words)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_needle_alone_equals_needle_in_any_batch(long_tiny, temperature):
    rng = random.Random(48)
    needle = "the cat sat on a blue mat and"
    kw = {"max_new_tokens": 6, "temperature": temperature, "top_logprobs": 5, "seed": 11, "stop_on_eos": False}
    alone = lmtrace.generate(long_tiny, needle, **kw)
    assert alone.model["config"]["batch_invariant"] is True
    for size in (2, 5, 16):
        others = [text(rng, rng.randint(5, 400 if size < 16 else 120), long_tiny.tokenizer) for _ in range(size - 1)]
        at = rng.randrange(size)
        batch = others[:at] + [needle] + others[at:]
        traces = lmtrace.generate(long_tiny, batch, **kw)
        assert numbers(traces[at]) == numbers(alone), (size, at)


def test_teacher_forcing_equals_the_decoded_steps(long_tiny):
    trace = lmtrace.generate(long_tiny, "the dog ran far over", max_new_tokens=8, temperature=0, top_logprobs=5,
                             stop_on_eos=False)  # fmt: skip
    ids = [s.token_id for s in trace.steps]
    from lmtrace.scoring.rollouts.report import rollouts  # teacher-forces token ids, no retokenizing

    report = rollouts(long_tiny, [{"id": "r", "prompt_ids": trace.prompt["token_ids"], "completion_ids": ids,
                                   "logprobs": [s.logprob for s in trace.steps]}])  # fmt: skip
    assert [t["raw_logprob"] for t in report["rollouts"][0]["tokens"]] == [s.logprob for s in trace.steps]
    assert report["summary"]["mean_abs_delta"] == 0.0


def test_the_numbers_stay_the_models(tiny_lm):
    prompts = ["Hello world, the quick", "Once upon a time there was a little model that"]
    kw = {"max_new_tokens": 8, "temperature": 0, "top_logprobs": 5}
    default = lmtrace.generate(tiny_lm, prompts, **kw)
    with lmtrace.batch_invariant(tiny_lm.model):
        invariant = lmtrace.generate(tiny_lm, prompts, **kw)
    for d, i in zip(default, invariant):
        assert [s.token_id for s in d.steps] == [s.token_id for s in i.steps]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(d.steps, i.steps)) <= 5e-5
        assert max(abs(a.entropy - b.entropy) for a, b in zip(d.steps, i.steps)) <= 5e-5


def test_leaving_the_context_restores_the_model(tiny_lm):
    model = tiny_lm.model
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        before = model(ids).logits
        with lmtrace.batch_invariant(model):
            assert model.config._attn_implementation == "lmtrace_batch_invariant"
            assert tiny_lm.record()["config"].get("batch_invariant") is None  # a summary made before
        after = model(ids).logits
    assert torch.equal(before, after)
    assert not any("forward" in vars(m) for m in model.modules())
    assert "batch_invariant" not in LM.from_objects(model, tiny_lm.tokenizer).record()["config"]


def test_a_trainer_under_batch_invariant_gets_the_engines_bits(long_tiny, tiny_tok):
    """A plain transformers model (a copy of the weights, not lmtrace's object), gradients on, a
    right-padded batch of 3: float32 log_softmax at the engine's tokens == the engine's logprobs,
    raw and (T 0.7) sampled; loss.backward() gives finite gradients."""
    prompts = ["the cat sat", "a blue mat and the dog ran far over the", "hills"]
    traces = lmtrace.generate(long_tiny, prompts, max_new_tokens=6, temperature=0.7, seed=5, stop_on_eos=False)
    trainer = LlamaForCausalLM(long_tiny.model.config.__class__.from_dict(long_tiny.model.config.to_dict()))
    trainer.config._attn_implementation = "sdpa"
    trainer.load_state_dict(long_tiny.model.state_dict())
    trainer.train()
    seqs = [t.prompt["token_ids"] + [s.token_id for s in t.steps] for t in traces]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tiny_tok.pad_token_id] * (width - len(s)) for s in seqs])  # right-padded
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with lmtrace.batch_invariant(trainer):
        logits = trainer(input_ids=ids, attention_mask=mask).logits.float()  # (3, width, vocab)
        raw, sampled = torch.log_softmax(logits, -1), torch.log_softmax(logits / 0.7, -1)
        loss = 0.0
        for r, t in enumerate(traces):
            start = len(t.prompt["token_ids"])
            positions = torch.arange(start - 1, start - 1 + len(t.steps))
            tokens = torch.tensor([s.token_id for s in t.steps])
            assert raw[r, positions, tokens].tolist() == [s.logprob for s in t.steps]
            assert sampled[r, positions, tokens].tolist() == [s.sampled_logprob for s in t.steps]
            loss = loss - sampled[r, positions, tokens].sum()
        loss.backward()
    grads = [p.grad for p in trainer.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert trainer.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"matmul": "onednn"}, "matmul"), ({"weights": "packed"}, "weights"), ({"dtype": "bfloat16"}, "dtype")],
)
def test_what_cannot_be_invariant_is_refused_naming_both(tiny_dir, kwargs, words):
    with pytest.raises(InvalidParameter, match=rf"^batch_invariant and {words} "):
        lmtrace.load(tiny_dir, batch_invariant=True, **kwargs)


def test_the_bundled_model_alone_equals_in_a_batch(bundled_lm):
    needle = "The capital of France is"
    others = ["Once upon a time, in a land far away, there lived a very old king who had", "2+2="]
    kw = {"max_new_tokens": 4, "temperature": 0, "top_logprobs": 5}
    with lmtrace.batch_invariant(bundled_lm):
        alone = lmtrace.generate(bundled_lm, needle, **kw)
        batch = lmtrace.generate(bundled_lm, [others[0], needle, others[1]], **kw)
    assert numbers(batch[1]) == numbers(alone)


@pytest.mark.parametrize("lone_alike", [True, False])
def test_a_lone_rows_product_is_the_rows_among_others(monkeypatch, lone_alike):
    """The invariant product of one row has the bits of that row among 2 to 16 rows, on the bundled
    model's five weight shapes, both where the lone row runs alone (its shape measured alike) and
    where it runs as a pair."""
    from lmtrace.model.invariant import products

    if not lone_alike:
        monkeypatch.setattr(products, "lone_row_alike", lambda *a: False)
    g = torch.Generator().manual_seed(3)
    for out, width in [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 576)]:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(out, width, generator=g), 8)
        x = torch.randn(16, width, generator=g)
        one = products.packed_product(x[:1], packed, None)
        for n in (2, 3, 7, 8, 16):
            assert torch.equal(one[0], products.packed_product(x[:n], packed, None)[0]), (out, width, n)


def test_attention_is_captured_on_the_invariant_kernel(tiny_lm):
    """The attention over the cache is recorded under batch_invariant (its weights computed aside,
    the output the invariant kernel's): the numbers are the invariant run's own bits, and the
    weights within 5e-5 of the default path's."""
    kw = {"max_new_tokens": 5, "temperature": 0, "top_logprobs": 3}
    with lmtrace.batch_invariant(tiny_lm.model):
        watched = lmtrace.generate(tiny_lm, "Once upon a time", attention="heads", **kw)
        plain = lmtrace.generate(tiny_lm, "Once upon a time", **kw)
    default = lmtrace.generate(tiny_lm, "Once upon a time", attention="heads", **kw)
    assert [s.logprob for s in watched.steps] == [s.logprob for s in plain.steps]
    assert watched.token_ids == default.token_ids
    for got, ref in zip(watched.steps, default.steps):
        for a, b in zip(got.attention["layers"], ref.attention["layers"]):
            assert [t["position"] for t in a["top"]] == [t["position"] for t in b["top"]]
            assert all(abs(x["weight"] - y["weight"]) <= 5e-5 for x, y in zip(a["top"], b["top"]))


def test_compile_is_refused_naming_both(tiny_lm):
    with lmtrace.batch_invariant(tiny_lm.model):
        with pytest.raises(InvalidParameter, match="^compile: compile cannot be combined with batch_invariant"):
            lmtrace.generate(tiny_lm, "Hi", max_new_tokens=2, compile=True)


def test_a_drafted_decode_equals_the_plain_one_bitwise(long_tiny):
    """Speculative decoding's verify rows (K + 1 positions in one forward) give the plain decode's
    numbers, bit for bit: greedy, the same tokens, logprobs, entropies and alternatives."""
    kw = {"max_new_tokens": 8, "temperature": 0, "top_logprobs": 5, "stop_on_eos": False}
    plain = lmtrace.generate(long_tiny, "the cat sat on a blue mat and", **kw)
    drafted = lmtrace.generate(long_tiny, "the cat sat on a blue mat and", draft="layers:1", draft_tokens=3, **kw)
    assert drafted.speculative["blocks"] >= 2 and any(s.draft is not None for s in drafted.steps)
    assert numbers(drafted) == numbers(plain)
