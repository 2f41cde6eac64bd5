"""The invariant attention under every mask lmtrace's forwards hand it (lmtrace.model.invariant.layout):
a prompt after its cached beginning (a causal mask offset by the cached length), prompts packed into
one row (each from its own cache hit, or from the beginning an earlier prompt of the pack computes)
with a running batch's decode step riding in the same forward (the server's and lmtrace batch's
joins): each gives, bit for bit, what it
gets alone (the cold prefill, the ordinary decode step). A trainer's packed sequences too. A mask
that adds a bias and a model whose attention has a window are refused in one line."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import LlamaForCausalLM

import lmtrace
from lmtrace import SamplingParams
from lmtrace.decode import engine, tracing, tree_prefill
from lmtrace.decode.continuous import generate_rows
from lmtrace.decode.prefill import PromptRow, prefill_many
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger
from lmtrace.kv.prefix import PrefixCache
from lmtrace.model.invariant import attention, mode
from lmtrace.model.lm import LM
from tests.test_batch_invariant import numbers
from tests.test_continuous import PROMPTS, SETTINGS, specs


@pytest.fixture(scope="module")
def invariant_lm(tiny_lm) -> LM:
    model = copy.deepcopy(tiny_lm.model)
    model.config.max_position_embeddings = 512
    mode.install(model)
    return LM.from_objects(model, tiny_lm.tokenizer, source="tiny-invariant")


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]  # 0 and 1: <eos>, <pad>


def same(a, b) -> None:
    """Two Prefilled: the same distribution, numbers and KV, bit for bit."""
    assert torch.equal(a.logits, b.logits)
    fields = ("logprob", "rank", "entropy", "top_ids", "top_logprobs")
    assert [getattr(a.numbers, f) for f in fields] == [getattr(b.numbers, f) for f in fields]
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(a.kv, b.kv))


def running_batch(lm: LM, prompts: list[list[int]]) -> tuple:
    """A left-padded batch after its prefill (cache, mask, next tokens, positions), as the continuous batch holds it."""
    ids, mask = engine.left_pad(prompts, lm.pad_token_id, lm.model.device)
    cache = ledger.new_cache(lm.model)
    logits = engine.prefill(lm.model, ids, mask, cache)
    return cache, mask, logits.argmax(-1), mask.sum(-1)


def test_cache_hits_packed_prompts_and_a_riding_step_give_their_lone_bits(invariant_lm):
    model, vocab = invariant_lm.model, len(invariant_lm.tokenizer)
    rng = random.Random(5)
    a, c = tokens(rng, 150, vocab), tokens(rng, 90, vocab)
    later = [
        a[:130] + tokens(rng, 20, vocab),  # a hit on a (129 tokens: the last shared one is computed again)
        c,
        c[:70] + tokens(rng, 30, vocab),  # its beginning from c, computed in the same pack
        a[:40] + tokens(rng, 75, vocab),  # a second hit on a's entry
    ]
    cache = PrefixCache(1 << 26)
    with torch.inference_mode():
        prefill_many(model, [PromptRow(a, top_n=5)], pad_id=invariant_lm.pad_token_id, cache=cache, keep_kv=True)
        kv, mask, step, positions = running_batch(invariant_lm, [tokens(rng, 9, vocab), tokens(rng, 70, vocab)])
        layers = [(k.clone(), v.clone()) for k, v in ledger.layers_of(kv)]
        alone = engine.decode_step(model, step, positions[:, None], torch.cat([mask, mask.new_ones((2, 1))], -1), kv)
        ride = tree_prefill.Ride(layers, mask, step, positions)
        rows = [PromptRow(ids, top_n=5) for ids in later]
        got = prefill_many(model, rows, pad_id=invariant_lm.pad_token_id, cache=cache, keep_kv=True, ride=ride)
        cold = [prefill_many(model, [row], pad_id=invariant_lm.pad_token_id, keep_kv=True)[0] for row in rows]
    assert [p.cached for p in got] == [129, 0, 70, 39]  # two hits on one entry, an anchor in the pack
    assert ride.logits is not None and torch.equal(ride.logits, alone)
    for (k, v), (k0, v0) in zip(ride.new, ledger.layers_of(kv)):  # the column the decode step appended
        assert torch.equal(k, k0[:, :, -1:]) and torch.equal(v, v0[:, :, -1:])
    for p, q in zip(got, cold):
        same(p, q)


def test_a_trainers_packed_sequences_equal_each_alone(invariant_lm, tiny_tok):
    """Two sequences in one row (a 4D mask: each attends its own columns, causally; position ids
    restart), gradients on: the logits of each equal its own forward's, bit for bit."""
    model = LlamaForCausalLM(copy.deepcopy(invariant_lm.model.config))
    model.config._attn_implementation = "sdpa"
    rng = random.Random(6)
    first, second = tokens(rng, 70, len(tiny_tok)), tokens(rng, 40, len(tiny_tok))
    allowed = torch.zeros(110, 110, dtype=torch.bool)
    allowed[:70, :70] = torch.ones(70, 70, dtype=torch.bool).tril()
    allowed[70:, 70:] = torch.ones(40, 40, dtype=torch.bool).tril()
    positions = torch.tensor([list(range(70)) + list(range(40))])
    with lmtrace.batch_invariant(model):
        both = model(torch.tensor([first + second]), attention_mask=allowed[None, None], position_ids=positions).logits
        one = model(torch.tensor([first])).logits
        two = model(torch.tensor([second])).logits
        both.float().log_softmax(-1).sum().backward()
    assert torch.equal(both[0, :70], one[0]) and torch.equal(both[0, 70:], two[0])
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_bias_mask_and_a_window_are_refused_in_one_line(invariant_lm):
    model = invariant_lm.model
    ids = torch.tensor([[5, 6, 7, 8]])
    bias = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    bias[0, 0, 3, 0] = -0.5  # an additive bias (ALiBi's kind): not a mask of seen and hidden keys
    with (
        torch.inference_mode(),
        pytest.raises(InvalidParameter, match=r"^batch_invariant: this attention mask adds a bias"),
    ):
        model(ids, attention_mask=bias)
    q = torch.zeros(1, 4, 4, 16)
    with pytest.raises(InvalidParameter, match=r"^batch_invariant: this model's attention \(a sliding window"):
        attention.invariant_attention(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, sliding_window=2)
    windowed = copy.deepcopy(model.config)
    windowed.sliding_window, windowed.use_sliding_window = 16, True
    plain = LlamaForCausalLM(windowed)
    with pytest.raises(InvalidParameter, match=r"^batch_invariant: this model attends over a sliding window"):
        mode.install(plain)


def test_rows_joining_a_running_batch_in_its_decode_forward_get_their_alone_bits(invariant_lm):
    """lmtrace batch's path (generate_rows): a row that finishes makes room, the next prompt is
    prefilled in the batch's decode forward (the step rides in the prompt's tree forward)."""
    together = generate_rows(invariant_lm, specs(invariant_lm), max_batch=2)
    for text, kw, trace in zip(PROMPTS, SETTINGS, together):
        assert numbers(trace) == numbers(tracing.generate(invariant_lm, text, SamplingParams(**kw)))
