"""Streaming: text is sent only when final (whole UTF-8 characters, never the start of a stop
string that then completes), and the chunks add up to exactly the non-streamed answer."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lmtrace.records import Step
from lmtrace.server import create_app
from lmtrace.server.sse import ChoiceStream, answer_pieces
from tests.server.conftest import sse_events


def step(text: str, token_id: int = 1) -> Step:
    return Step(0, token_id, text, list(text.encode()), -1.0, -1.0, 1, 0.0, 0.0, [], {}, 0.0)


def feed(stream: ChoiceStream, pieces: list[str], eos_last: bool = False) -> list[str]:
    return [stream.add(step(p), eos_last and i == len(pieces) - 1)[0] for i, p in enumerate(pieces)]


def test_a_possible_stop_string_is_held_until_it_completes():
    s = ChoiceStream(["ab"])
    assert feed(s, ["x", "a", "b"]) == ["x", "", ""]
    delta, ready = s.finish("x")
    assert delta == "" and [p for _, p in ready] == ["", ""]


def test_held_text_is_released_when_the_stop_string_does_not_follow():
    s = ChoiceStream(["ab"])
    assert feed(s, ["x", "a", "c"]) == ["x", "", "ac"]
    assert s.finish("xac")[0] == ""


def test_a_stop_string_inside_one_token_cuts_there():
    s = ChoiceStream(["ab", "zz"])
    assert feed(s, ["xa", "bc"]) == ["x", ""]
    assert s.finish("x")[0] == ""


def test_tokens_go_out_with_the_text_they_release():
    s = ChoiceStream([])
    _, ready = s.add(step(""), False)  # the first bytes of a character: nothing to show yet
    assert [p for _, p in ready] == [""]
    delta, ready = s.add(step("好"), False)
    assert delta == "好" and [p for _, p in ready] == ["好"]


def test_the_end_token_text_is_never_sent():
    s = ChoiceStream([])
    assert feed(s, ["a", "<eos>"], eos_last=True) == ["a", ""]
    delta, ready = s.finish("a")
    assert delta == "" and [p for _, p in ready] == [""]


def test_answer_pieces_cut_at_the_answer():
    steps = [step("x"), step("a"), step("b")]
    assert answer_pieces(steps, "x") == ["x", "", ""]
    assert answer_pieces([step("a"), step("")], "a\ufffd") == ["a", "\ufffd"]  # completed by the flush


def collect_completion(events: list, n: int = 1):
    text, finish = [""] * n, [None] * n
    lps = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in range(n)]
    for e in events:
        assert e["object"] == "text_completion"
        for c in e["choices"]:
            i = c["index"]
            text[i] += c["text"]
            if c["logprobs"]:
                for k in lps[i]:
                    lps[i][k] += c["logprobs"][k]
            if c["finish_reason"]:
                assert finish[i] is None
                finish[i] = c["finish_reason"]
    return text, lps, finish


def both(client, route: str, body: dict):
    plain = client.post(route, json=body)
    streamed = client.post(route, json={**body, "stream": True})
    assert plain.status_code == streamed.status_code == 200, (plain.text, streamed.text)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    return plain.json(), sse_events(streamed.text)


def check_completion(client, body: dict) -> dict:
    plain, events = both(client, "/v1/completions", body)
    n = body.get("n", 1)
    text, lps, finish = collect_completion(events, n)
    for i, c in enumerate(plain["choices"]):
        assert text[i] == c["text"]
        assert finish[i] == c["finish_reason"]
        if body.get("logprobs") is not None:
            assert lps[i] == c["logprobs"]
    return plain


def greedy_text(client, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return client.post("/v1/completions", json=body).json()["choices"][0]["text"]


CASES = [
    {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "logprobs": 2},
    {"prompt": "很久很久以前，", "max_tokens": 24, "temperature": 0, "logprobs": 1},  # characters split over tokens
    {"prompt": "🙂 wörld", "max_tokens": 16, "temperature": 0.9, "seed": 3, "logprobs": 0},
    {"prompt": "Once upon", "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True},
    {"prompt": "Once upon", "max_tokens": 10, "temperature": 1.0, "seed": 9, "n": 2, "logprobs": 1},
    {"prompt": "Hello", "max_tokens": 6, "seed": 1},  # no logprobs: text only
]


@pytest.mark.parametrize("body", CASES, ids=[str(i) for i in range(len(CASES))])
def test_streamed_completion_equals_non_streamed(client, body):
    check_completion(client, body)


def test_stop_strings_streamed_equal_non_streamed(client):
    full = greedy_text(client, "Once upon a time", 40)
    stop = full[10:13]
    assert len(stop) == 3
    plain = check_completion(
        client, {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "logprobs": 1, "stop": [stop, "qqq"]}
    )
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.find(stop)]
    # every step is in the logprobs, the one that completed the stop string included
    assert len(choice["logprobs"]["tokens"]) == plain["usage"]["completion_tokens"]


def test_end_of_sequence_streamed_equals_non_streamed(eos_lm):
    with TestClient(create_app(eos_lm, name="tiny")) as c:
        plain = check_completion(c, {"prompt": "Hello world", "max_tokens": 20, "temperature": 0, "logprobs": 1})
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"][-1] == " l"  # the end token is the last entry, its text not in the answer
    assert not choice["text"].endswith(" l")


def test_streamed_chat_equals_non_streamed(client):
    body = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "很久以前"}],
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    plain, events = both(client, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"})
    _, events = both(client, "/v1/chat/completions", body)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    content, logprobs, finish = "", [], None
    for e in events[1:-1]:
        (c,) = e["choices"]
        content += c["delta"].get("content", "")
        logprobs += c["logprobs"]["content"] if c["logprobs"] else []
        finish = c["finish_reason"] or finish
    want = plain["choices"][0]
    assert content == want["message"]["content"]
    assert logprobs == want["logprobs"]["content"]
    assert finish == want["finish_reason"]


def test_streamed_trace_steps_equal_the_final_trace(client):
    body = {"prompt": "很久很久以前，", "max_tokens": 10, "temperature": 0, "stream": True}
    events = sse_events(client.post("/v1/traces", json=body).text)
    steps = [e["step"] for e in events if e["object"] == "trace.step"]
    (final,) = [e["trace"] for e in events if e["object"] == "trace"]
    assert steps == final["steps"] and len(steps) == 10
    assert "".join(s["text"] for s in steps).startswith(final["text"])
