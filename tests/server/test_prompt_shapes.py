"""OpenAI's four prompt shapes on /v1/completions and /v1/traces (with the official `openai`
client on a real server), and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.server import create_app
from tests.same_record import assert_same
from tests.server.conftest import sse_events

openai = pytest.importorskip("openai")
PROMPTS = ["Hello world", "Once upon a time", "很久很久以前，"]


@pytest.fixture
def oai(running):
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)


def shapes(lm) -> dict[str, object]:
    ids = [lmtrace.encode_prompt(lm, p) for p in PROMPTS]
    return {"string": PROMPTS[1], "ids": ids[1], "strings": PROMPTS, "id lists": ids}


@pytest.mark.parametrize("shape", ["string", "ids", "strings", "id lists"])
def test_the_four_shapes_with_the_openai_client(oai, chat_lm, shape):
    prompt = shapes(chat_lm)[shape]
    c = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True, n=2)
    texts = PROMPTS if shape in ("strings", "id lists") else [PROMPTS[1]]
    assert [ch.index for ch in c.choices] == list(range(2 * len(texts)))  # index = prompt_index * n + j
    prompt_tokens = 0
    for ch in c.choices:
        text = texts[ch.index // 2]
        trace = lmtrace.generate(chat_lm, text, max_new_tokens=5, temperature=0, top_logprobs=2)
        n_prompt = len(trace.prompt["token_ids"])
        prompt_tokens += n_prompt if ch.index % 2 == 0 else 0
        assert ch.text == text + trace.text  # echo of its own prompt
        assert ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.tokens) == n_prompt + 5
        got = ch.logprobs.token_logprobs[n_prompt:]
        assert max(abs(a - s.logprob) for a, s in zip(got, trace.steps)) <= 1e-4
    assert c.usage.prompt_tokens == prompt_tokens  # each prompt counted once, whatever n
    assert c.usage.completion_tokens == 5 * len(c.choices)


def test_streaming_several_prompts_gives_each_choice_its_index(oai):
    args = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    whole = oai.completions.create(prompt=PROMPTS, **args)
    texts = {i: "" for i in range(len(PROMPTS))}
    finished = set()
    for chunk in oai.completions.create(prompt=PROMPTS, stream=True, **args):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == set(texts) and [texts[i] for i in sorted(texts)] == [ch.text for ch in whole.choices]


def test_traces_take_a_list_and_answer_a_list(client, chat_lm):
    d = client.post("/v1/traces", json={"prompt": PROMPTS, "max_tokens": 4, "temperature": 0}).json()
    assert list(d) == ["traces"] and len(d["traces"]) == 3
    for text, got in zip(PROMPTS, d["traces"]):
        alone = lmtrace.generate(chat_lm, text, max_new_tokens=4, temperature=0).to_dict()
        alone["model"]["source"] = "tiny"
        got.pop("versions"), alone.pop("versions")
        assert_same(got, alone)
    single = client.post("/v1/traces", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}).json()
    assert "traces" not in single and single["prompt"]["text"] == PROMPTS[0]
    r = client.post("/v1/traces", json={"prompt": PROMPTS[:2], "max_tokens": 3, "temperature": 0, "stream": True})
    events = sse_events(r.text)
    assert {e["index"] for e in events if e["object"] == "trace.step"} == {0, 1}
    assert [e["index"] for e in events if e["object"] == "trace"] == [0, 1]


def test_tokenize_and_detokenize_as_vllm(client, chat_lm):
    ids = lmtrace.encode_prompt(chat_lm, "Hello world")
    d = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert d == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    strs = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"]
    assert strs == chat_lm.tokenizer.convert_ids_to_tokens(ids)
    msgs = [{"role": "user", "content": "Say hi."}]
    chat = client.post("/tokenize", json={"model": "tiny", "messages": msgs}).json()
    assert chat["tokens"] == lmtrace.encode_prompt(chat_lm, "Say hi.", chat=True)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": chat_lm.tokenizer.decode(ids)}
    both = client.post("/tokenize", json={"messages": msgs, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    bad = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "tokens must be in [0, 299], got 1000000"
    assert client.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_the_one_at_a_time_server_answers_a_list_the_same(client, chat_lm):
    from fastapi.testclient import TestClient

    from lmtrace.server import create_app

    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    together = client.post("/v1/completions", json=body).json()
    with TestClient(create_app(chat_lm, name="tiny", max_batch=1)) as old:
        one_by_one = old.post("/v1/completions", json=body).json()
    for key in ("id", "created"):
        together.pop(key), one_by_one.pop(key)
    assert_same(together, one_by_one)


TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if think %}<think>{% endif %}{% endif %}"
)


def test_tokenize_hands_tools_and_template_variables_to_the_chat_template(chat_lm):
    tok = copy.deepcopy(chat_lm.tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    lm = dataclasses.replace(chat_lm, tokenizer=tok)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with TestClient(create_app(lm, name="tiny")) as c:
        got = c.post("/tokenize", json={"messages": msgs, "tools": tools, "chat_template_kwargs": {"think": True}})
        plain = c.post("/tokenize", json={"messages": msgs}).json()
        clash = c.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": {"tools": []}})
    text = "<|tools|>get_weather;<|user|>Weather in Paris?\n<|assistant|><think>"
    assert got.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert plain["tokens"] == tok("<|user|>Weather in Paris?\n<|assistant|>", add_special_tokens=False)["input_ids"]
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"
