"""logit_bias on /v1/completions, /v1/chat/completions and /v1/traces (the tiny model, in-process),
from vLLM's test_chat_logit_bias_validation requests: +100 makes greedy decoding pick the token at
every step, -100 removes it, and every reported logprob equals transformers' logits plus the bias,
log-softmaxed, in the mode the docs name ("sampled"; "raw", the default, stays the model's own).
Bad keys are 400s naming them (tests/server/test_errors.py)."""

from __future__ import annotations

import torch

USER = [{"role": "user", "content": "Hello world"}]


def _post(client, route: str, **body) -> dict:
    r = client.post(route, json={"temperature": 0, "max_tokens": 5, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _trace(client, **body) -> dict:
    return _post(client, "/v1/traces", **body)


def oracle(lm, prompt_ids: list[int], ids: list[int], bias: dict[str, float]) -> tuple[list, list, list]:
    """(raw logprobs, biased logprobs, argmax of the biased logits) of `ids` after `prompt_ids`,
    from transformers' logits of one uncached forward pass."""
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt_ids + ids])).logits[0].float()  # (len, vocab)
    steps = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(ids)]  # (n, vocab)
    vector = torch.zeros(steps.shape[-1])
    for token, value in bias.items():
        vector[int(token)] = value
    raw, biased = torch.log_softmax(steps, -1), torch.log_softmax(steps + vector, -1)
    at = torch.tensor(ids)[:, None]
    return raw.gather(-1, at)[:, 0].tolist(), biased.gather(-1, at)[:, 0].tolist(), (steps + vector).argmax(-1).tolist()


def test_plus_100_picks_the_token_at_every_step_and_minus_100_removes_it(client, chat_lm):
    pinned = chat_lm.tokenizer.decode([50])
    completion = _post(client, "/v1/completions", prompt="Hello world", logit_bias={"50": 100})
    assert completion["choices"][0]["text"] == pinned * 5
    chat = _post(client, "/v1/chat/completions", messages=USER, logit_bias={"50": 100})
    assert chat["choices"][0]["message"]["content"] == pinned * 5
    assert [s["token_id"] for s in _trace(client, prompt="Hello world", logit_bias={"50": 100})["steps"]] == [50] * 5

    for fields, route in (({"prompt": "Hello world"}, "/v1/completions"), ({"messages": USER}, "/v1/chat/completions")):
        free = [s["token_id"] for s in _trace(client, **fields)["steps"]]
        banned = {str(t): -100 for t in free}  # every token greedy chose, removed
        again = _trace(client, **fields, logit_bias=banned)
        assert not {s["token_id"] for s in again["steps"]} & set(free)
        choice = _post(client, route, **fields, logit_bias=banned)["choices"][0]
        assert choice.get("text", (choice.get("message") or {}).get("content")) == again["text"]


def test_each_logprob_is_the_oracles_in_the_documented_mode(client, chat_lm):
    free = _trace(client, prompt="Hello world")["steps"]
    # the greedy path moved: its first token pushed down, another pulled up, one removed
    bias = {str(free[0]["token_id"]): -4.0, "61": 3.5, "62": -100, "299": 1.0}
    for fields, route in (({"prompt": "Hello world"}, "/v1/completions"), ({"messages": USER}, "/v1/chat/completions")):
        trace = _trace(client, **fields, logit_bias=bias, logprobs_mode="sampled")
        prompt, ids = trace["prompt"]["token_ids"], [s["token_id"] for s in trace["steps"]]
        raw, biased, argmax = oracle(chat_lm, prompt, ids, bias)
        assert ids == argmax and ids != [s["token_id"] for s in free]
        assert max(abs(s["sampled_logprob"] - b) for s, b in zip(trace["steps"], biased)) <= 1e-5
        assert max(abs(s["logprob"] - r) for s, r in zip(trace["steps"], raw)) <= 1e-5
        for mode, want in (("sampled", biased), ("raw", raw)):
            if route == "/v1/completions":
                got = _post(client, route, **fields, logit_bias=bias, logprobs=2, logprobs_mode=mode)
                numbers = got["choices"][0]["logprobs"]["token_logprobs"]
            else:
                got = _post(client, route, **fields, logit_bias=bias, logprobs=True, logprobs_mode=mode)
                numbers = [c["logprob"] for c in got["choices"][0]["logprobs"]["content"]]
            assert len(numbers) == len(want) and max(abs(a - b) for a, b in zip(numbers, want)) <= 1e-5, mode


def test_the_last_id_of_the_vocabulary_is_taken(client, chat_lm):
    """vLLM's test_chat_logit_bias_valid: the largest token id with a bias of 1."""
    last = chat_lm.model.config.vocab_size - 1
    chat = _post(client, "/v1/chat/completions", messages=USER, logit_bias={str(last): 1.0})
    assert chat["choices"][0]["message"]["content"] is not None
    r = client.post("/v1/chat/completions", json={"messages": USER, "logit_bias": {str(last + 2): 1.0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert str(last + 2) in r.json()["error"]["message"] and str(last + 1) in r.json()["error"]["message"]
