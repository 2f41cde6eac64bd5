"""The OpenAI-compatible routes and /v1/traces on the tiny model: shapes, and numbers equal to
lmtrace.generate's (the server adds no arithmetic of its own)."""

from __future__ import annotations

import math

import pytest
import torch

import lmtrace
from lmtrace.records import Trace
from lmtrace.server.logprobs import completion_token


def test_models(client):
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["tiny"]
    assert client.get("/v1/models/tiny").json()["object"] == "model"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_greedy_completion_logprobs_equal_generate(client, chat_lm):
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0, "logprobs": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    d = r.json()
    assert d["object"] == "text_completion" and d["model"] == "tiny" and d["id"].startswith("cmpl-")
    trace = lmtrace.generate(chat_lm, "Hello world", max_new_tokens=8, temperature=0, top_logprobs=3)
    choice = d["choices"][0]
    assert choice["text"] == trace.text and choice["finish_reason"] == trace.finish_reason == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [s.logprob for s in trace.steps]  # exactly, not approximately
    for top, step in zip(lp["top_logprobs"], trace.steps):
        expected = {completion_token(a.bytes): a.logprob for a in step.top}
        assert {k: v for k, v in top.items() if k in expected} == expected
        assert len(top) in (3, 4)  # N alternatives, plus the chosen token when not among them
    # offsets count from the start of the prompt, also without echo (as OpenAI)
    full = "Hello world" + choice["text"]
    pieces = [s.text for s in trace.steps]
    assert lp["text_offset"][0] == len("Hello world")
    for offset, piece in zip(lp["text_offset"], pieces):
        assert full[offset:].startswith(piece)
    assert d["usage"] == {
        "prompt_tokens": len(trace.prompt["token_ids"]),
        "completion_tokens": 8,
        "total_tokens": len(trace.prompt["token_ids"]) + 8,
    }


def test_token_id_prompt_equals_string_prompt(client, chat_lm):
    ids = lmtrace.encode_prompt(chat_lm, "Once upon a time")
    common = {"max_tokens": 6, "temperature": 0, "logprobs": 2}
    by_text = client.post("/v1/completions", json={"prompt": "Once upon a time", **common}).json()
    by_ids = client.post("/v1/completions", json={"prompt": ids, **common}).json()
    assert by_ids["choices"][0]["logprobs"] == by_text["choices"][0]["logprobs"]
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_echo_puts_the_prompt_first_with_a_null_first_logprob(client, chat_lm):
    prompt = "the quick brown fox"
    d = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    ).json()
    choice = d["choices"][0]
    ids = lmtrace.encode_prompt(chat_lm, prompt)
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][: len(ids)][0] == 0
    # the prompt's logprobs: one teacher-forced forward pass, checked against the model itself
    with torch.no_grad():
        ref = torch.log_softmax(chat_lm.model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-5)
    # and the completion's equal a generation with echo (one pass: the prefill that scores the
    # prompt starts the generation), and a plain one within float noise
    trace = lmtrace.generate(chat_lm, prompt, max_new_tokens=4, temperature=0, top_logprobs=2, echo=True)
    assert lp["token_logprobs"][len(ids) :] == [s.logprob for s in trace.steps]
    assert choice["text"] == prompt + trace.text
    plain = lmtrace.generate(chat_lm, prompt, max_new_tokens=4, temperature=0, top_logprobs=2)
    assert lp["token_logprobs"][len(ids) :] == pytest.approx([s.logprob for s in plain.steps], abs=1e-5)


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, chat_lm):
    d = client.post(
        "/v1/completions", json={"prompt": "Hello world", "max_tokens": 0, "echo": True, "logprobs": 1}
    ).json()
    ids = lmtrace.encode_prompt(chat_lm, "Hello world")
    assert d["choices"][0]["text"] == "Hello world"
    assert len(d["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert d["usage"]["completion_tokens"] == 0


def test_sampled_mode_gives_the_processed_distribution(client, chat_lm):
    args = {"temperature": 0.7, "top_k": 3, "seed": 11}
    d = client.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "logprobs": 5, "logprobs_mode": "sampled", **args}
    ).json()
    trace = lmtrace.generate(chat_lm, "Hello", max_new_tokens=6, top_logprobs=5, **args)
    lp = d["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [s.sampled_logprob for s in trace.steps]
    # the 5 raw alternatives; top_k=3 filtered two of them: OpenAI's -9999.0 stands for -inf
    assert all(sorted(t.values()).count(-9999.0) >= 2 for t in lp["top_logprobs"])
    raw = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "logprobs": 5, **args}).json()
    assert raw["choices"][0]["logprobs"]["token_logprobs"] == [s.logprob for s in trace.steps]


def test_same_seed_same_output_and_n_choices(client):
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 2, "logprobs": 1}
    a = client.post("/v1/completions", json=body).json()
    b = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert a["choices"] == b["choices"]
    assert a["choices"][0]["text"] != a["choices"][1]["text"]  # one sampler over the batch
    assert a["usage"]["completion_tokens"] == 16


def test_chat_logprobs_equal_the_library_export(client, chat_lm):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    d = client.post("/v1/chat/completions", json=body).json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-")
    trace = lmtrace.generate(chat_lm, "Say hi.", chat=True, max_new_tokens=6, temperature=0, top_logprobs=3)
    choice = d["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": trace.text}
    assert choice["logprobs"] == trace.to_openai()
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 3
    assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert d["usage"]["completion_tokens"] == 6


def test_chat_without_logprobs_and_with_list_content(client):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 3}
    d = client.post("/v1/chat/completions", json=body).json()
    assert d["choices"][0]["logprobs"] is None and d["choices"][0]["finish_reason"] in ("stop", "length")


def test_traces_return_the_full_trace(client, chat_lm):
    d = client.post(
        "/v1/traces", json={"prompt": "Hello world", "max_tokens": 5, "temperature": 0, "top_logprobs": 4}
    ).json()
    trace = Trace.from_dict(d)
    assert d["schema_version"] == 1 and d["model"]["source"] == "tiny"
    ref = lmtrace.generate(chat_lm, "Hello world", max_new_tokens=5, temperature=0, top_logprobs=4)
    for got, want in zip(trace.steps, ref.steps):
        assert (got.token_id, got.logprob, got.sampled_logprob, got.rank, got.kv) == (
            want.token_id,
            want.logprob,
            want.sampled_logprob,
            want.rank,
            want.kv,
        )
        assert [a.token_id for a in got.top] == [a.token_id for a in want.top]
    assert trace.steps[0].kv["seq_len"] == len(ref.prompt["token_ids"]) and trace.steps[0].kv["bytes"] > 0
    chat = client.post("/v1/traces", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).json()
    assert chat["params"]["chat"] is True and math.isfinite(chat["steps"][0]["entropy"])


def test_viewer_page_is_self_contained(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    page = r.text
    assert "/v1/traces" in page and "textContent" in page
    assert "innerHTML" not in page and "http://" not in page and "https://" not in page
