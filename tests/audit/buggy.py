"""A small FastAPI app in front of a real `lmtrace serve` app (in-process) that reproduces one
known engine bug at a time, so each audit probe can be shown to catch its bug, and only its bug.
Each bug is applied where that engine applied it: what another probe looks at stays right."""

from __future__ import annotations

import asyncio
import codecs
import copy
import json
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from lmtrace.comparison.parse import token_bytes

# bug -> the probe that must catch it (and the upstream report it stands for)
BUGS = {
    "processed": "logprobs",  # vLLM #9453: processed values where raw were expected
    "zero_logprobs": "logprobs",  # llama.cpp #27972, vLLM #17876: logprob 0.0 under speculative decoding
    "echo_generation_only": "echo",  # llama.cpp #27174: echo returns the generated tokens' logprobs only
    "bos_offsets": "echo",  # lmtrace issue 35: echo offsets shifted by len("<bos>"), then backwards
    "duplicate_top": "top_logprobs",  # vLLM #36660 / #36746: the sampled token twice in top_logprobs
    "stream_misaligned": "streaming",  # streamed logprobs one chunk behind the streamed text
    "prompts_order": "prompts",  # a prompt list's choices in another order than their indices say
    "stale_repeat": "repeat",  # vLLM #42019 / #42245: stale prompt logprobs from a warm prefix cache
    "batch_dependent": "concurrency",  # vLLM RFC #42259: numbers that depend on the batch
    "wrong_usage": "usage",  # completion_tokens off by one
    "stop_logprobs": "stop",  # a stop string cuts the text but not the logprobs
    "chat_off_by_one": "chat",  # chat logprobs read one row early
    "lossy_bytes": "bytes",  # a token that is not whole UTF-8 written "" (its bytes lost)
    "tokenize_no_generation_prompt": "tokenize",  # /tokenize of messages without the assistant's opening
}


def _events(text: str) -> list[Any]:
    datas = [b[len("data: ") :] for b in text.split("\n\n") if b.startswith("data: ")]
    return [json.loads(d) for d in datas if d != "[DONE]"]


def _sse(events: list[Any]) -> Response:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return Response(body, media_type="text/event-stream")


class Bugs:
    """The request and answer rewrites of one bug (None: a faithful proxy)."""

    def __init__(self, bug: str | None):
        self.bug = bug
        self.seen: dict[str, list[float]] = {}  # echo prompt -> its prompt logprobs (stale_repeat)
        self.active: set[int] = set()  # requests in flight (batch_dependent)
        self.crowded: set[int] = set()

    def request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        if self.bug == "processed" and body.get("temperature") not in (None, 0, 0.0, 1, 1.0):
            body["logprobs_mode"] = "sampled"
        if self.bug == "stop_logprobs" and path == "/v1/completions":
            body.pop("stop", None)
        if self.bug == "tokenize_no_generation_prompt" and path == "/tokenize" and "messages" in body:
            body["add_generation_prompt"] = False
        return body

    def answer(self, path: str, body: dict[str, Any], d: dict[str, Any], key: int) -> dict[str, Any]:
        for c in d.get("choices") or []:
            lp = c.get("logprobs")
            if path == "/v1/completions" and lp:
                self._completion(body, c, lp, d.get("usage") or {}, key)
            if path == "/v1/chat/completions" and lp:
                self._chat(lp["content"])
        if path == "/v1/completions" and isinstance(body.get("prompt"), list) and self.bug == "prompts_order":
            d["choices"].reverse()  # their indices kept: 3, 2, 1, 0
        if self.bug == "wrong_usage" and path == "/v1/completions" and d.get("usage"):
            d["usage"]["completion_tokens"] += 1
            d["usage"]["total_tokens"] += 1
        return d

    def _completion(self, body: dict, c: dict, lp: dict, usage: dict, key: int) -> None:
        values = lp["token_logprobs"]
        prompt_n = len(values) - usage.get("completion_tokens", len(values)) if body.get("echo") else 0
        if self.bug == "zero_logprobs":
            values[prompt_n:] = [0.0] * (len(values) - prompt_n)
        if self.bug == "echo_generation_only" and body.get("echo"):
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[name] = lp[name][prompt_n:]
        if self.bug == "bos_offsets" and body.get("echo"):  # as if a "<bos>" had been counted
            lp["text_offset"][1:prompt_n] = [o + len("<bos>") for o in lp["text_offset"][1:prompt_n]]
        if self.bug == "stale_repeat" and body.get("echo"):
            prompt = str(body["prompt"])
            if prompt in self.seen:  # a prefix-cache hit: the cached rows come back stale
                values[1:prompt_n] = [v - 0.25 for v in self.seen[prompt][1:prompt_n]]
            self.seen[prompt] = list(values)
        if self.bug == "batch_dependent" and key in self.crowded:
            lp["token_logprobs"] = [v if v is None else v - 0.05 for v in values]
        if self.bug == "stop_logprobs" and body.get("stop"):
            cut = min((c["text"].find(s) for s in body["stop"] if s in c["text"]), default=-1)
            if cut >= 0:
                c["text"], c["finish_reason"] = c["text"][:cut], "stop"
        if self.bug == "lossy_bytes":
            lp["tokens"] = _pieces(lp["tokens"])

    def _chat(self, content: list[dict[str, Any]]) -> None:
        if self.bug == "duplicate_top":
            for item in content:
                item["top_logprobs"].append({k: item[k] for k in ("token", "logprob", "bytes")})
        if self.bug == "chat_off_by_one":
            values = [item["logprob"] for item in content]
            for item, value in zip(content, [-0.5, *values[:-1]]):
                item["logprob"] = value
        if self.bug == "lossy_bytes":
            for item, piece in zip(content, _pieces([bytes(item["bytes"]) for item in content])):
                item["token"], item["bytes"] = piece, list(piece.encode("utf-8"))

    def stream(self, path: str, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        choices = [c for e in events for c in e.get("choices") or [] if c.get("logprobs")]
        if path == "/v1/chat/completions":  # the items of all chunks, in order, as one answer's
            self._chat([item for c in choices for item in c["logprobs"]["content"]])
        for c in choices if path == "/v1/completions" else []:
            lp = c["logprobs"]
            if self.bug == "zero_logprobs":
                lp["token_logprobs"] = [0.0] * len(lp["token_logprobs"])
        if self.bug == "lossy_bytes" and path == "/v1/completions":
            pieces = iter(_pieces([t for c in choices for t in c["logprobs"]["tokens"]]))
            for c in choices:
                c["logprobs"]["tokens"] = [next(pieces) for _ in c["logprobs"]["tokens"]]
        if self.bug == "stream_misaligned" and path == "/v1/completions":
            _shift(events)
        return events


def _pieces(tokens: list[str | bytes]) -> list[str]:
    """Each token as the text it completes, as vLLM writes it: "" for a token that ends inside a
    character, the whole character for the one that finishes it (its own bytes are lost)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = [decoder.decode(t if isinstance(t, bytes) else token_bytes(t, None)) for t in tokens]
    if out:
        out[-1] += decoder.decode(b"", final=True)
    return out


def _shift(events: list[dict[str, Any]]) -> None:
    """Each chunk's logprobs one chunk later; the last chunk's join the final one."""
    with_choices = [e["choices"][0] for e in events if e.get("choices")]
    lps = [c.get("logprobs") for c in with_choices]
    for c, lp in zip(with_choices, [None, *lps[:-1]]):
        c["logprobs"] = lp
    if lps and lps[-1] and with_choices[-1]["logprobs"]:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            with_choices[-1]["logprobs"][name] += lps[-1][name]


def _refused(path: str, body: dict[str, Any], refuse: set[str]) -> Response | None:
    """What a server that does not offer a route or a feature answers."""
    if "tokenize" in refuse and path in ("/tokenize", "/detokenize"):
        return JSONResponse({"detail": "Not Found"}, 404)
    if "echo" in refuse and body.get("echo"):
        return JSONResponse({"error": {"message": "echo is not supported", "code": 400}}, 400)
    if "n" in refuse and body.get("n", 1) > 1 and body.get("temperature") == 0:
        return JSONResponse({"error": {"message": "n must be 1 when using greedy sampling, got 2."}}, 400)
    return None


def buggy_app(inner: FastAPI, bug: str | None, refuse: set[str] = frozenset()) -> FastAPI:
    """The proxy; `inner` is create_app(...) of the model under test. `refuse`: what it does not
    offer ("tokenize": the routes; "echo"; "n": n > 1 with greedy decoding, as vLLM)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}")
    bugs = Bugs(bug)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=inner), base_url="http://testserver", timeout=60)
    app = FastAPI()
    counter = iter(range(1 << 30))

    @app.get("/v1/models")
    async def models() -> Any:
        return (await client.get("/v1/models")).json()

    @app.post("/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        path, body, key = "/" + path, await request.json(), next(counter)
        refused = _refused(path, body, refuse)
        if refused is not None:
            return refused
        if bug == "batch_dependent":  # requests that arrive together overlap in flight
            bugs.crowded.update(bugs.active | {key} if bugs.active else set())
            bugs.active.add(key)
            await asyncio.sleep(0.2)
        try:
            answer = await client.post(path, json=bugs.request(path, body))
        finally:
            bugs.active.discard(key)
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json")
        if body.get("stream"):
            return _sse(bugs.stream(path, _events(answer.text)))
        return JSONResponse(bugs.answer(path, body, answer.json(), key))

    return app
