"""A prompt far beyond the context is refused by its length before it is tokenized
(lmtrace.server.length): the bound is a true lower bound on the tokens, for any text; a tokenizer
that could cover more characters than its token strings (a normalizer, an added token that strips
the spaces beside it, a pre-tokenizer that drops whitespace) gets no bound and is tokenized in
full; a prompt the bound cannot decide still gets its exact count."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, normalizers, pre_tokenizers

from lmtrace.server import create_app
from lmtrace.server.length import check_length, longest_token
from tests.tiny import tiny_tokenizer

TOK = tiny_tokenizer()
# texts of the tokenizer's own pieces (so long tokens occur), any characters and its specials
PIECES = st.sampled_from(sorted(TOK.get_vocab(), key=len)[-40:] + ["Hello", " world", "\n", "  ", "<eos>", "é"])
TEXTS = st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=60).map("".join)


@settings(max_examples=300, deadline=None)
@given(TEXTS)
def test_the_bound_never_exceeds_the_tokens(text):
    assert -(-len(text) // longest_token(TOK)) <= len(TOK(text)["input_ids"])


def test_the_bound_holds_for_the_bundled_tokenizer(bundled_lm):
    tok = bundled_lm.tokenizer
    longest = longest_token(tok)
    assert longest == max(len(s) for s in tok.get_vocab())
    for text in [
        "#" * 80 * 7 + "x",
        "\n" + " " * 80,
        "Hello world, " * 300,
        "é€😀" * 50,
        max(tok.get_vocab(), key=len),
    ]:
        assert -(-len(text) // longest) <= len(tok(text)["input_ids"]), text


def test_the_longest_token_is_the_longest_string():
    assert longest_token(TOK) == max(len(s) for s in TOK.get_vocab()) == 6


def _changed(change) -> object:
    tok = copy.deepcopy(TOK)
    change(tok)
    return tok


@pytest.mark.parametrize(
    "change",
    [
        lambda t: setattr(t.backend_tokenizer, "normalizer", normalizers.NFKC()),
        lambda t: setattr(t.backend_tokenizer, "pre_tokenizer", pre_tokenizers.Whitespace()),
        lambda t: t.add_tokens([AddedToken("<sep>", lstrip=True)]),
    ],
    ids=["normalizer", "whitespace dropped", "lstrip"],
)
def test_a_tokenizer_without_a_bound_is_tokenized_in_full(change, chat_lm):
    tok = _changed(change)
    assert longest_token(tok) is None
    check_length(dataclasses.replace(chat_lm, tokenizer=tok), "a" * 100_000, 1)  # no refusal: nothing proven


def test_a_prompt_far_beyond_the_context_is_refused_by_its_length(chat_lm):
    text = "Hello world, " * 20_000  # 260,000 characters, at least 43,334 tokens; the context is 256
    with TestClient(create_app(chat_lm, name="tiny")) as c:
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt"
        assert err["message"] == (
            "prompt is too long: it has 260000 characters, so at least 43334 tokens (no token of this model is "
            "longer than 6 characters), and the model's context holds 256 tokens; with max_tokens 4 the prompt "
            "may have at most 252"
        )
        r = c.post("/v1/completions", json={"prompt": ["Hi", text], "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[1] is too long: it has 260000")
        for route, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
            ("/v1/responses", {"input": text}),
            ("/v1/traces", {"messages": [{"role": "user", "content": text}]}),
        ]:
            err = c.post(route, json=body).json()["error"]
            assert err["param"] == "messages" and err["message"].startswith("chat prompt is too long: it has 2600"), (
                route
            )
        err = c.post("/v1/traces", json={"prompt": text}).json()["error"]
        assert err["param"] == "prompt" and "so at least 43334 tokens" in err["message"]
        assert c.post("/tokenize", json={"prompt": "Hello world, " * 100}).json()["count"] > 256  # counted, not refused


def test_a_prompt_the_bound_cannot_decide_gets_its_exact_count(chat_lm):
    with TestClient(create_app(chat_lm, name="tiny")) as c:
        # 1,300 characters: at least 217 tokens by length, which fits; tokenized, 600 do not
        err = c.post("/v1/completions", json={"prompt": "Hello world, " * 100, "max_tokens": 4}).json()["error"]
        assert err["message"].startswith("prompt is too long: it has ") and "characters" not in err["message"]
        # the bound proves the prompt too long only with max_tokens: it is blamed on the prompt
        # only where check_fits would blame it (the larger part)
        err = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 256}).json()["error"]
        assert err["param"] == "max_tokens"
