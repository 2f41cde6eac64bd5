"""Fields OpenAI's and vLLM's clients send to chat, and what answers carry back (tiny model,
in-process): `chat_template_kwargs` handed to the model's chat template (as /tokenize does), an
assistant turn's `reasoning_content` (dropped by a template with no place for it), `store` and
`metadata` accepted, and `system_fingerprint` on chat and completion answers, streamed or not:
lmtrace's version and a hash of the model's record, the same for every answer of one model.
docs/server.md's table of OpenAI's request fields names every field the `openai` client declares,
and the server refuses (in one line, naming it) or ignores each as the table says."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from lmtrace import __version__
from lmtrace.server import create_app, generation
from tests.server.conftest import CHATML, sse_events

USER = [{"role": "user", "content": "Hello"}]


def test_chat_template_kwargs_reach_the_template(chat_lm):
    tok = copy.deepcopy(chat_lm.tokenizer)
    tok.chat_template = "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}" + CHATML
    with TestClient(create_app(dataclasses.replace(chat_lm, tokenizer=tok), name="tiny")) as c:
        body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
        assert c.post("/v1/traces", json=body).json()["prompt"]["text"] == "/no_think\n<|user|>Hello\n<|assistant|>"
        assert c.post("/v1/traces", json={**body, "chat_template_kwargs": None}).json()["prompt"]["text"] == (
            "<|user|>Hello\n<|assistant|>")  # fmt: skip
        chat = c.post("/v1/chat/completions", json={**body, "store": False, "metadata": {"run": "a"}})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(tok("/no_think\n<|user|>Hello\n<|assistant|>")["input_ids"])
        for fields, param in (({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                              ({"prompt": "Hi", "messages": None}, "chat_template_kwargs")):  # fmt: skip
            r = c.post("/v1/traces", json={**body, **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_reasoning_content_without_a_place_in_the_template_is_dropped(client):
    history = [*USER, {"role": "assistant", "content": "Hi!", "reasoning_content": "A greeting."}, *USER]
    plain = [*USER, {"role": "assistant", "content": "Hi!"}, *USER]
    got = [client.post("/v1/traces", json={"messages": m, "max_tokens": 1}).json()["prompt"] for m in (history, plain)]
    assert got[0] == got[1] and "greeting" not in got[0]["text"]


def test_system_fingerprint_on_every_answer(client, chat_lm, eos_lm):
    body = {"max_tokens": 2, "temperature": 0}
    answers = [client.post("/v1/chat/completions", json={**body, "messages": USER}).json(),
               client.post("/v1/completions", json={**body, "prompt": "Hello"}).json()]  # fmt: skip
    for route, fields in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hello"})):
        answers += sse_events(client.post(route, json={**body, **fields, "stream": True}).text)
    prints = {a["system_fingerprint"] for a in answers}
    (fingerprint,) = prints
    assert fingerprint.startswith(f"lmtrace-{__version__}-") and len(fingerprint) == len(f"lmtrace-{__version__}-") + 12
    # stable: another server of the same model says the same; another model says another
    assert fingerprint == generation.fingerprint(chat_lm) == generation.fingerprint(copy.deepcopy(chat_lm))
    assert generation.fingerprint(eos_lm) != fingerprint


# --- docs/server.md's table of OpenAI's request fields, held to the client and to the server ---

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
ROUTES = {"/v1/chat/completions": {"messages": USER, "max_tokens": 1},
          "/v1/completions": {"prompt": "Hello", "max_tokens": 1},
          "/v1/responses": {"input": "Hello", "max_output_tokens": 1}}  # fmt: skip
IGNORED = {"store": False, "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
           "parallel_tool_calls": True}  # fmt: skip


def documented() -> dict[str, dict[str, str]]:
    """{route: {field: "takes" | "refuses" | "ignores"}} from the section's three tables."""
    section = DOCS.read_text(encoding="utf-8").split("## OpenAI's request fields", 1)[1].split("\n## ", 1)[0]
    out: dict[str, dict[str, str]] = {}
    for part in section.split("**`POST ")[1:]:
        route, rows = part.split("`**", 1)
        table = out.setdefault(route, {})
        for row in re.findall(r"^\| (.+?) \| (\w+)", rows, re.M):
            for name in re.findall(r"`([a-z_]+)`", row[0]):
                table[name] = row[1]
    return out


def test_the_table_lists_every_field_of_openais_client():
    openai = pytest.importorskip("openai")
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    declared = {"/v1/chat/completions": chat_create_params.CompletionCreateParamsBase,
                "/v1/completions": completion_create_params.CompletionCreateParamsBase,
                "/v1/responses": response_create_params.ResponseCreateParamsBase}  # fmt: skip
    table = documented()
    assert set(table) == set(ROUTES)
    for route, params in declared.items():
        missing = (set(params.__annotations__) | {"stream"}) - set(table[route])
        assert not missing, f"{route}: docs/server.md says nothing of {sorted(missing)} (openai {openai.__version__})"
        assert set(table[route].values()) <= {"takes", "refuses", "ignores"}


def test_the_server_does_what_the_table_says(client):
    for route, base in ROUTES.items():
        for field, verdict in documented()[route].items():
            if verdict == "refuses":
                r = client.post(route, json={**base, field: "x"})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == field and "\n" not in err["message"], (route, field)
            elif verdict == "ignores" and field in IGNORED:
                r = client.post(route, json={**base, field: IGNORED[field]})
                assert r.status_code == 200, (route, field, r.text)
