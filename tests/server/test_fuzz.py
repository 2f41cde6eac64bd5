"""Property-based requests (hypothesis) against the generating routes: near-valid bodies with
wild values, wrong types, unknown fields, odd Unicode (lone surrogates included), bodies that
are not JSON objects, and unknown routes. Whatever comes in: no 5xx, no stack trace or server
path in the answer, every rejection in OpenAI's error envelope, and afterwards the server
still gives a known request the same answer as before."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmtrace.server import create_app
from tests.server.conftest import sse_events
from tests.server.test_worker import wait_until

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same requests on every run: a failure here is reproducible
    database=None,
    suppress_health_check=list(HealthCheck),
)
SRC = str(Path(__file__).resolve().parents[2])
# what a leaked traceback or server path looks like
LEAKS = re.compile(r'Traceback \(most recent call last\)|File "|site-packages|/usr/lib/|/home/|/tmp/|/work/')

# --- values. Wild: anything JSON carries, ranges' edges, lone surrogates, NaN and infinity.
ints = st.one_of(st.integers(-3, 6), st.sampled_from([2**31, 2**63, 2**64, 2**70, -(2**63), 10**30]), st.integers())
floats = st.one_of(
    st.floats(-2, 3, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, float("nan"), float("inf"), float("-inf")]),
)
text = st.one_of(
    st.text(max_size=12), st.sampled_from(["", " ", "\ud800", "a\udfffb", "\x00", "<eos>", "很久", "🙂", "</script>"])
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, text)
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6
)
WILD = {
    "model": st.sampled_from(["other", "\ud800", "tiny "]),
    "max_tokens": ints,
    "prompt": st.one_of(text, st.lists(ints, max_size=6)),
    "messages": st.lists(st.fixed_dictionaries({"role": text, "content": anything}), max_size=2),
    "logprobs": ints,
    "top_logprobs": ints,
    **dict.fromkeys(["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"], floats),
    **dict.fromkeys(["top_k", "seed", "n", "best_of"], ints),
    "stop": st.one_of(text, st.lists(text, max_size=6)),
}

# --- valid: what a careful client sends, so that much of the fuzzing reaches the model
VOCAB = 300  # the tiny tokenizer's (tests/tiny.py)
words = st.text(min_size=1, max_size=12)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.one_of(st.text(max_size=12), st.just([{"type": "text", "text": "hi"}])),
        }
    ),
    min_size=1,
    max_size=3,
)
SAMPLING = {
    "model": st.just("tiny"),
    "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 5),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.one_of(st.integers(0, 9), st.just(2**64 - 1)),
    "stop": st.one_of(words, st.lists(words, max_size=4)),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logprobs_mode": st.sampled_from(["raw", "sampled"]),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.just(0),
    "user": words,
}
PROMPT = st.one_of(words, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
TOKENS = st.integers(1, 4)  # small, so that every request is quick
COMPLETION = {**SAMPLING, "logprobs": st.integers(0, 20), "echo": st.booleans(), "best_of": st.just(1)}
CHAT = {**SAMPLING, "top_logprobs": st.integers(0, 20)}
TRACE = {**{k: v for k, v in SAMPLING.items() if k != "n"}, "top_logprobs": st.integers(0, 100)}


@st.composite
def bodies(draw, required: dict, optional: dict, one_of: dict | None = None) -> tuple[str, object]:
    """(kind, body): a valid body (with exactly one of the fields `one_of`), the same with one
    or two fields made wild or an unknown field added, or anything at all."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if one_of:
        name = draw(st.sampled_from(list(one_of)))
        body[name] = draw(one_of[name])
    kind = draw(st.sampled_from(["valid", "valid", "valid", "wild fields", "wild fields", "anything"]))
    if kind == "anything":
        return kind, draw(anything)
    if kind == "wild fields":
        for _ in range(draw(st.integers(1, 2))):
            name = draw(st.sampled_from([*optional, *required, *(one_of or ()), "unknown"]))
            body[name] = draw(WILD.get(name, anything))
    return kind, body


ROUTES = {
    "/v1/completions": bodies({"prompt": PROMPT, "max_tokens": TOKENS}, COMPLETION),
    # logprobs true, as top_logprobs needs it
    "/v1/chat/completions": bodies({"messages": messages, "max_tokens": TOKENS, "logprobs": st.just(True)}, CHAT),
    "/v1/traces": bodies({"max_tokens": TOKENS}, TRACE, {"prompt": PROMPT, "messages": messages}),
}
KNOWN = {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "logprobs": 3}


@pytest.fixture(scope="module")
def fuzzed(chat_lm):
    """A client whose requests are counted, and the known request's answer before the fuzzing."""
    with TestClient(create_app(chat_lm, name="tiny", max_concurrency=4), raise_server_exceptions=False) as c:
        c.count = Counter()
        yield c, answer(c.post("/v1/completions", json=KNOWN))
        assert answer(c.post("/v1/completions", json=KNOWN)) == answer(c.post("/v1/completions", json=KNOWN))
        print(f"\nfuzzed {c.count.total()} requests: {dict(c.count)}")


def answer(r) -> list:
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def check(r) -> None:
    """One answer: no 5xx, no leak, the envelope on every rejection, SSE that ends in [DONE]."""
    assert r.status_code < 500, r.text
    assert not LEAKS.search(r.text) and SRC not in r.text, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        for event in sse_events(r.text):
            assert "error" not in event, event  # an error after the 200 would be a server failure
    else:
        assert isinstance(r.json(), dict)


def send(client, path: str, body, raw: bool = False):
    # allow_nan: NaN and Infinity go out as the literals a careless client sends
    content = body if raw else json.dumps(body, allow_nan=True)
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    client.count[r.status_code] += 1
    return r


@pytest.mark.parametrize("path", list(ROUTES))
def test_fuzz_route(fuzzed, path):
    client, _ = fuzzed

    @SETTINGS
    @given(ROUTES[path])
    def one(kind_body):
        kind, body = kind_body
        r = send(client, path, body)
        check(r)
        if kind == "valid":  # what a careful client sends is answered
            assert r.status_code == 200, (body, r.text)

    one()


@SETTINGS
@given(
    path=st.sampled_from(list(ROUTES)),
    raw=st.one_of(st.binary(max_size=40), st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass"))),
)
def test_fuzz_bodies_that_are_not_json(fuzzed, path, raw):
    check(send(fuzzed[0], path, raw, raw=True))


@settings(SETTINGS, max_examples=40)
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]), path=st.text(max_size=20))
def test_fuzz_methods_and_paths(fuzzed, method, path):
    client = fuzzed[0]
    r = client.request(method, "/v1/" + quote(path.encode("utf-8", "surrogatepass")))
    client.count[r.status_code] += 1
    check(r)


FOUND = [  # what the fuzzing found (500s before the fix): now a 400 naming the field, or an answer
    ("/v1/completions", {"prompt": "Hi", "model": "\ud800"}, 400),
    ("/v1/completions", {"prompt": "a\udfffb"}, 400),
    ("/v1/completions", {"prompt": "Hi", "stop": ["\ud800"]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400),
    ("/v1/completions", {"prompt": "Hi", "\ud800": 1}, 400),
    ("/v1/completions", {"prompt": "0", "temperature": 1.2e-64}, 200),
    ("/v1/traces", {"prompt": "0", "temperature": 0.5, "repetition_penalty": 1e-300}, 200),
]


@pytest.mark.parametrize("path,fields,status", FOUND)
def test_what_fuzzing_found(fuzzed, path, fields, status):
    r = send(fuzzed[0], path, {"max_tokens": 3, **fields})
    check(r)
    assert r.status_code == status, r.text
    if status == 400:
        assert "\ufffd" in r.text or "surrogate" in r.text


def test_still_answers_after_fuzzing(fuzzed):
    client, before = fuzzed
    assert answer(send(client, "/v1/completions", KNOWN)) == before
    worker = client.app.state.lmtrace.worker
    wait_until(lambda: worker.admitted == 0)  # every slot comes back (released just after the answer)
