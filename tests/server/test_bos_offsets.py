"""A tokenizer that adds a BOS (Gemma, Llama): /v1/completions' `text_offset` equals the
tokenizer's own offset mapping over the echoed prompt (the BOS at 0, adding no characters),
then goes on, never backwards, through the generated tokens; streamed the same."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from lmtrace.model.lm import LM
from lmtrace.server import create_app
from tests.server.conftest import sse_events
from tests.tiny import bos_tokenizer, tiny_model

PROMPT = "Hello world, the quick brown fox"


@pytest.fixture(scope="module")
def bos_lm() -> LM:
    tok = bos_tokenizer()
    return LM.from_objects(tiny_model(tok), tok, source="tiny-bos")


@pytest.fixture(scope="module")
def client(bos_lm):
    with TestClient(create_app(bos_lm, name="tiny")) as c:
        yield c


def ask(client, **extra):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, **extra}
    return client.post("/v1/completions", json=body)


def test_echo_offsets_are_the_tokenizers_own(client, bos_lm):
    enc = bos_lm.tokenizer(PROMPT, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    assert ids[0] == bos_lm.tokenizer.bos_token_id and spans[0] == (0, 0)  # the tokenizer really adds one
    choice = ask(client, echo=True).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"][0] == "<bos>" and lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + 6
    assert lp["text_offset"][: len(ids)] == [start for start, _ in spans]
    offsets, text = lp["text_offset"], choice["text"]
    assert text.startswith(PROMPT) and "<bos>" not in text
    assert offsets == sorted(offsets) and offsets[len(ids)] == len(PROMPT)  # never backwards
    for offset, token in list(zip(offsets, lp["tokens"]))[1 : len(ids)]:
        assert text[offset:].startswith(token)
    plain = ask(client).json()["choices"][0]["logprobs"]
    assert plain["text_offset"] == offsets[len(ids) :] and plain["tokens"] == lp["tokens"][len(ids) :]


def test_streamed_echo_offsets_equal_the_whole_answer(client):
    whole = ask(client, echo=True).json()["choices"][0]["logprobs"]
    events = sse_events(ask(client, echo=True, stream=True).text)
    offsets = [o for e in events if e != "[DONE]" for c in e["choices"] if c["logprobs"]
               for o in c["logprobs"]["text_offset"]]  # fmt: skip
    assert offsets == whole["text_offset"], json.dumps(events[:2])[:400]


def test_the_audits_echo_offset_check_passes_them_and_catches_the_shift(client, bos_lm):
    from lmtrace.comparison.audit.probes_model import ECHO_PROMPT, offset_problem

    body = {"prompt": ECHO_PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    n = len(bos_lm.tokenizer(ECHO_PROMPT)["input_ids"])
    assert offset_problem(choice, n) is None
    offsets = choice["logprobs"]["text_offset"]
    offsets[1:n] = [o + len("<bos>") for o in offsets[1:n]]  # the bug: the BOS counted as text
    assert "goes backwards" in offset_problem(choice, n)
