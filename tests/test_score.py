"""Teacher-forced scoring against an independent uncached forward pass on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

import lmtrace
from lmtrace import InvalidParameter
from lmtrace.scoring.teacher.score import ScoreResult, spans

TEXT = "Once upon a time there was a little model. 很久很久以前 🙂 naïve café"
# longer than the tiny model's 256 positions
LONG = " ".join(["Hello world, the quick brown fox jumps over the lazy dog. 很久很久以前，有一个小模型。"] * 12)


def oracle(lm, ids: list[int]) -> torch.Tensor:
    """(len, vocab) raw log-probs from one plain forward pass (row i predicts ids[i + 1])."""
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def test_text_matches_one_forward_pass(tiny_lm):
    r = lmtrace.score(tiny_lm, TEXT, top_logprobs=4)
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    lp = oracle(tiny_lm, ids)
    assert r.token_ids == ids and r.prompt_token_ids == [] and len(r.tokens) == len(ids)
    first = r.tokens[0]
    assert (first.logprob, first.rank, first.entropy, first.top) == (None, None, None, [])
    worst = 0.0
    for i, t in enumerate(r.tokens[1:], start=1):
        row = lp[i - 1]
        worst = max(worst, abs(t.logprob - row[ids[i]].item()))
        assert t.rank == int((row > row[ids[i]]).sum()) + 1
        assert t.entropy == pytest.approx(-(row.exp() * row).sum().item(), abs=1e-5)
        assert [c.token_id for c in t.top] == torch.topk(row, 4).indices.tolist()
        assert [c.logprob for c in t.top] == pytest.approx(torch.topk(row, 4).values.tolist(), abs=1e-5)
    assert worst < 1e-5
    assert "".join(t.text for t in r.tokens) == tiny_lm.tokenizer.decode(ids)


def test_totals(tiny_lm):
    r = lmtrace.score(tiny_lm, TEXT)
    lps = [t.logprob for t in r.tokens[1:]]
    assert r.scored_tokens == len(ids := r.token_ids) - 1
    assert r.total_logprob == pytest.approx(sum(lps), abs=1e-9)
    assert r.perplexity == pytest.approx(math.exp(-sum(lps) / len(lps)), rel=1e-9)
    nbytes = sum(len(t.bytes) for t in r.tokens[1:])
    assert nbytes == len(TEXT.encode()) - len(r.tokens[0].bytes) and r.scored_bytes == nbytes
    assert r.bits_per_byte == pytest.approx(-sum(lps) / math.log(2) / nbytes, rel=1e-9)
    assert len(ids) > 10


def test_prompt_conditions_only_the_continuation(tiny_lm):
    r = lmtrace.score(tiny_lm, prompt="Once upon a time", continuation=" there was a model")
    tok = tiny_lm.tokenizer
    head, tail = tok("Once upon a time")["input_ids"], tok(" there was a model", add_special_tokens=False)["input_ids"]
    assert r.prompt_token_ids == head and r.token_ids == tail and r.scored_tokens == len(tail)
    lp = oracle(tiny_lm, head + tail)
    expected = [lp[len(head) + i - 1, t].item() for i, t in enumerate(tail)]
    assert max(abs(t.logprob - e) for t, e in zip(r.tokens, expected)) < 1e-5
    assert "".join(t.text for t in r.tokens) == " there was a model"
    assert r.text == " there was a model" and r.prompt == "Once upon a time"


def test_spans_score_every_token_once_with_enough_context():
    for n, window, stride in [(10, 4, 1), (100, 16, 5), (257, 256, 128), (1000, 64, 63), (5, 8, 4)]:
        seen = []
        for begin, end, first in spans(n, window, stride):
            assert end - begin <= window and first > begin
            assert first - begin >= min(window - stride, first)  # context of the first target
            seen += range(first, end)
        assert seen == list(range(1, n))


def test_longer_than_the_context_uses_the_sliding_window(tiny_lm):
    ids = tiny_lm.tokenizer(LONG)["input_ids"]
    context = tiny_lm.model.config.max_position_embeddings
    assert len(ids) > context
    r = lmtrace.score(tiny_lm, LONG, top_logprobs=2)  # defaults: window = context, stride = context / 2
    assert (r.window, r.stride) == (context, context // 2)
    assert r.scored_tokens == len(ids) - 1
    # independently: token t is scored in the first window that reaches it, windows starting
    # at multiples of the stride, by one plain forward pass over that window
    worst, windows = 0.0, {}
    for t in range(1, len(ids)):
        j = 0 if t < context else (t - context) // r.stride + 1
        begin = j * r.stride
        if begin not in windows:
            windows[begin] = oracle(tiny_lm, ids[begin : begin + context])
        worst = max(worst, abs(r.tokens[t].logprob - windows[begin][t - begin - 1, ids[t]].item()))
        assert t - begin >= context - r.stride or begin == 0
    assert worst < 1e-5
    # a token past the first window really gets its window's context (not the whole text's):
    t = len(ids) - 1
    begin = ((t - context) // r.stride + 1) * r.stride
    alone = oracle(tiny_lm, ids[begin : t + 1])[-2, ids[t]].item()
    assert abs(r.tokens[t].logprob - alone) < 1e-5


def test_small_window_and_stride(tiny_lm):
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    r = lmtrace.score(tiny_lm, TEXT, window=8, stride=3)
    for t in range(1, len(ids)):
        begin = 0 if t < 8 else ((t - 8) // 3 + 1) * 3
        exact = oracle(tiny_lm, ids[begin : t + 1])[-2, ids[t]].item()
        assert abs(r.tokens[t].logprob - exact) < 1e-5


def test_batch_equals_one_at_a_time(tiny_lm):
    items = [TEXT, ("Hello", " world"), LONG[:200], "x", ("很久很久以前，", "有一个小模型。")]
    done = []
    batch = lmtrace.score_batch(tiny_lm, items, batch_size=3, on_result=lambda i, r: done.append(i))
    assert sorted(done) == list(range(len(items)))
    for item, b in zip(items, batch):
        if isinstance(item, str):
            alone = lmtrace.score(tiny_lm, item)
        else:
            alone = lmtrace.score(tiny_lm, prompt=item[0], continuation=item[1])
        assert b.token_ids == alone.token_ids and b.scored_tokens == alone.scored_tokens
        for x, y in zip(b.tokens, alone.tokens):
            assert (x.logprob is None) == (y.logprob is None)
            if x.logprob is not None:
                assert abs(x.logprob - y.logprob) < 1e-5 and x.rank == y.rank
    long = lmtrace.score_batch(tiny_lm, [LONG, "Hello"], batch_size=2)[0]  # windowed, alone
    assert long.total_logprob == pytest.approx(lmtrace.score(tiny_lm, LONG).total_logprob, abs=1e-4)


def test_score_on_a_list_is_batched_and_equals_each_alone(tiny_lm):
    items = [TEXT, ("Hello", " world"), "Once upon a time", ("很久很久以前，", "有一个小模型。")]
    batched = lmtrace.score(tiny_lm, items, top_logprobs=2, batch_size=4)
    assert isinstance(batched, list) and len(batched) == len(items)
    for item, b in zip(items, batched):
        one = lmtrace.score(tiny_lm, item, top_logprobs=2) if isinstance(item, str) else (
            lmtrace.score(tiny_lm, prompt=item[0], continuation=item[1], top_logprobs=2))  # fmt: skip
        assert b.token_ids == one.token_ids and [t.rank for t in b.tokens] == [t.rank for t in one.tokens]
        assert b.total_logprob == pytest.approx(one.total_logprob, abs=1e-4)
    with pytest.raises(InvalidParameter, match="a list of texts takes no prompt"):
        lmtrace.score(tiny_lm, ["a"], prompt="b")


def test_json_round_trip(tiny_lm):
    r = lmtrace.score(tiny_lm, prompt="Hello", continuation=" world 🙂")
    d = r.to_dict()
    assert d["tokens"][0]["logprob"] is not None and "perplexity" in d and "tokens" in d
    back = ScoreResult.from_dict(d)
    assert back == r and back.to_json() == r.to_json()
    one = lmtrace.score(tiny_lm, "x").to_dict()
    assert one["tokens"][0]["logprob"] is None and one["perplexity"] is None


BAD = [
    (dict(text="Hello", window=1), "window must be in [2, 256], got 1"),
    (dict(text="Hello", window=300), "window must be in [2, 256], got 300"),
    (dict(text="Hello", window=16, stride=16), "stride must be in [1, 15], got 16"),
    (dict(text="Hello", top_logprobs=101), "top_logprobs must be in [0, 100], got 101"),
    (dict(text=""), "text must contain at least one token, got ''"),
    (dict(prompt="Hello"), "continuation: none given"),
    (dict(prompt="Hello", continuation=""), "continuation must contain at least one token, got ''"),
    (dict(text="a", prompt="b", continuation="c"), "text: give a text, or a prompt and a continuation, not both"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_names_the_parameter(tiny_lm, kwargs, message):
    with pytest.raises(InvalidParameter) as e:
        lmtrace.score(tiny_lm, **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_batches_are_bounded_by_size_and_padded_tokens():
    from lmtrace.scoring.teacher.score import _groups

    lengths = [5, 300, 40, 6, 100, 7, 90, 8]
    groups = _groups(lengths, batch_size=3, window=256)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) <= 3 and (len(g) * longest <= 256 or g == [1])
    assert [1] in groups  # longer than the window: alone (sliding window)


def test_batch_item_must_be_a_text_or_a_pair(tiny_lm):
    with pytest.raises(InvalidParameter, match=r"items\[1\] must be a text or a \(prompt, continuation\) pair, got 3"):
        lmtrace.score_batch(tiny_lm, ["ok", 3])
