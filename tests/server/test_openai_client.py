"""The official `openai` package against a real server on a loopback port (skipped where the
package is not installed: it is not a dependency of lmtrace)."""

from __future__ import annotations

import pytest

import lmtrace

openai = pytest.importorskip("openai")


@pytest.fixture
def oai(running):
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_with_logprobs_and_echo(oai, chat_lm):
    c = oai.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0, logprobs=2, echo=True)
    lp = c.choices[0].logprobs
    n_prompt = c.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and len(lp.tokens) == n_prompt + 6
    # one pass: the prefill that scores the prompt starts the generation, as generate(echo=True)
    trace = lmtrace.generate(chat_lm, "Hello world", max_new_tokens=6, temperature=0, top_logprobs=2, echo=True)
    assert lp.token_logprobs[n_prompt:] == [s.logprob for s in trace.steps]
    assert lp.token_logprobs[1:n_prompt] == [t.logprob for t in trace.prompt_logprobs[1:]]
    assert c.choices[0].text == "Hello world" + trace.text
    assert isinstance(lp.top_logprobs[1], dict) and len(lp.text_offset) == len(lp.tokens)


def test_chat_with_logprobs(oai, chat_lm):
    msgs = [{"role": "user", "content": "Say hi."}]
    c = oai.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    trace = lmtrace.generate(chat_lm, "Say hi.", chat=True, max_new_tokens=5, temperature=0, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert [t.logprob for t in content] == [s.logprob for s in trace.steps]
    assert content[0].bytes == trace.steps[0].bytes and len(content[0].top_logprobs) == 2
    assert c.choices[0].message.content == trace.text


def test_streaming_both_routes(oai):
    msgs = [{"role": "user", "content": "Hi"}]
    args = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    plain = oai.chat.completions.create(messages=msgs, **args).choices[0].message.content
    chunks = oai.chat.completions.create(messages=msgs, stream=True, logprobs=True, **args)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain
    plain = oai.completions.create(prompt="Once upon", **args).choices[0].text
    chunks = oai.completions.create(prompt="Once upon", stream=True, **args)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain


def test_extensions_and_errors(oai):
    c = oai.completions.create(
        model="tiny", prompt="Hi", max_tokens=3, seed=1, logprobs=1, extra_body={"top_k": 3, "logprobs_mode": "sampled"}
    )
    assert len(c.choices[0].logprobs.tokens) == 3
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="Hi", top_p=2.0)
    assert e.value.param == "top_p" and "top_p must be in (0, 1], got 2.0" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="Hi")
    assert e.value.code == "model_not_found"
