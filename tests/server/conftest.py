"""Fixtures for the server tests: the tiny model behind the app, in-process (TestClient) or
on a real uvicorn server bound to a free loopback port."""

from __future__ import annotations

import copy
import dataclasses
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient

from lmtrace.server import create_app

CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def chat_lm(tiny_lm):
    """The tiny model with a chat template (on its own tokenizer copy)."""
    tok = copy.deepcopy(tiny_lm.tokenizer)
    tok.chat_template = CHATML
    return dataclasses.replace(tiny_lm, tokenizer=tok, source="tiny-chat")


@pytest.fixture(scope="session")
def long_lm(chat_lm):
    """The tiny chat model with a context long enough for the tools' system prompt (its
    byte-level vocabulary spends a token on about every character)."""
    model = copy.deepcopy(chat_lm.model)
    model.config.max_position_embeddings = 2048
    return dataclasses.replace(chat_lm, model=model)


@pytest.fixture(scope="session")
def eos_lm(tiny_lm):
    """The tiny model with an end token it really produces: greedy 'Hello world' emits ' l'
    within a few steps, so generations end with finish_reason 'stop' by EOS."""
    eos = tiny_lm.tokenizer.convert_tokens_to_ids("Ġl")
    return dataclasses.replace(tiny_lm, eos_token_ids=[eos], source="tiny-eos")


@pytest.fixture(scope="module")
def client(chat_lm):
    with TestClient(create_app(chat_lm, name="tiny")) as c:
        yield c


def sse_events(text: str) -> list:
    """The data of each server-sent event; the last one must be [DONE]."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    datas = [b[len("data: ") :] for b in blocks]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class RunningServer:
    """A real uvicorn server in a thread, on a free loopback port, stopped on exit."""

    def __init__(self, app):
        self.app = app
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()


@pytest.fixture
def running(chat_lm):
    with RunningServer(create_app(chat_lm, name="tiny", max_concurrency=2)) as server:
        yield server


@pytest.fixture(scope="module")
def slow_lm(tiny_tok):
    """Its own tiny model that sleeps 10 ms per forward pass, so that a long generation is
    still running while a test does something else."""
    from lmtrace.model.lm import LM
    from tests.tiny import tiny_model

    model = tiny_model(tiny_tok)
    model.register_forward_pre_hook(lambda *_: time.sleep(0.01))
    return LM.from_objects(model, tiny_tok, source="tiny-slow")
