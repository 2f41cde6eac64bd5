"""Reads the logprobs of a saved response in the shapes engines write: OpenAI /v1/completions
(with or without echo; llama-cpp-python's create_completion is the same shape), OpenAI
/v1/chat/completions (`logprobs.content`), llama.cpp server /completion
(`completion_probabilities`, new rows with `logprob`/`top_logprobs` or `prob`/`top_probs`, and
the legacy `probs` rows), and an lmtrace trace. A file may also wrap the response with the
request that produced it: {"request": {...}, "response": {...}}."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from lmtrace.errors import InvalidParameter

_HEX_BYTES = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass
class Token:
    """One reported token: its text, bytes and id where the engine gave them, its logprob."""

    text: str
    logprob: float | None
    bytes: list[int] | None = None
    id: int | None = None
    top: list[Token] = field(default_factory=list)


@dataclass
class Reported:
    kind: str  # "openai-completions", "openai-chat", "llama.cpp", "lmtrace"
    tokens: list[Token]
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_ids: list[int] | None = None
    echo: bool = False  # the tokens start with the prompt (OpenAI echo)
    settings: dict[str, Any] = field(default_factory=dict)


def token_bytes(text: str, given: list[int] | None) -> bytes:
    """The bytes a reported token stands for: as given, from OpenAI's `bytes:\\xe5` form, or UTF-8."""
    if given is not None:
        return bytes(given)
    if text.startswith("bytes:"):
        return bytes(int(h, 16) for h in _HEX_BYTES.findall(text))
    return text.encode("utf-8")


def _lp(value: Any) -> float | None:
    return None if value is None else float(value)


def _from_prob(p: Any) -> float | None:
    return None if p is None else (math.log(p) if p > 0 else float("-inf"))


def _openai_completion(choice: dict[str, Any]) -> list[Token]:
    lp = choice["logprobs"]
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    out = []
    for text, value, top in zip(lp["tokens"], lp["token_logprobs"], tops):
        alts = [Token(t, _lp(v)) for t, v in (top or {}).items()]
        out.append(Token(text, _lp(value), top=alts))
    return out


def _openai_chat(choice: dict[str, Any]) -> list[Token]:
    out = []
    for item in choice["logprobs"]["content"]:
        alts = [Token(a["token"], _lp(a["logprob"]), a.get("bytes")) for a in item.get("top_logprobs") or []]
        out.append(Token(item["token"], _lp(item["logprob"]), item.get("bytes"), top=alts))
    return out


def _llama_cpp(rows: list[dict[str, Any]]) -> list[Token]:
    out = []
    for row in rows:
        if "probs" in row and "content" in row:  # legacy rows: probabilities of the top tokens only
            alts = [Token(p["tok_str"], _from_prob(p["prob"])) for p in row["probs"]]
            own = next((a.logprob for a in alts if a.text == row["content"]), None)
            out.append(Token(row["content"], own, top=alts))
            continue
        top_key, value_key = ("top_logprobs", "logprob") if "logprob" in row else ("top_probs", "prob")
        convert = _lp if value_key == "logprob" else _from_prob
        alts = [Token(a["token"], convert(a[value_key]), a.get("bytes"), a.get("id")) for a in row.get(top_key) or []]
        out.append(Token(row["token"], convert(row[value_key]), row.get("bytes"), row.get("id"), alts))
    return out


def _lmtrace(d: dict[str, Any]) -> Reported:
    # a trace of model.generate's scores only (lmtrace.from_generate) reports the processed numbers
    key = "sampled_logprob" if d.get("distributions") == "processed" else "logprob"
    tokens = [
        Token(
            s["text"],
            _lp(s[key]),
            s["bytes"],
            s["token_id"],
            [Token(a["text"], _lp(a[key]), a["bytes"], a["token_id"]) for a in s["top"]],
        )
        for s in d["steps"]
    ]
    settings = {k: d["params"].get(k) for k in ("temperature", "top_k", "top_p", "min_p")}
    return Reported("lmtrace", tokens, d["prompt"]["text"], prompt_ids=d["prompt"]["token_ids"], settings=settings)


def parse_response(data: dict[str, Any]) -> Reported:
    """Recognises the shape of `data` and reads its tokens; raises InvalidParameter otherwise."""
    wrapped = isinstance(data.get("response"), dict)
    request = data.get("request") if wrapped and isinstance(data.get("request"), dict) else {}
    body = data["response"] if wrapped else data
    if not isinstance(body, dict):
        raise InvalidParameter("response: expected a JSON object")
    if "schema_version" in body and "steps" in body:
        return _lmtrace(body)
    settings = {k: request[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in request}
    prompt = request.get("prompt") if isinstance(request.get("prompt"), str) else None
    if "completion_probabilities" in body:
        tokens = _llama_cpp(body["completion_probabilities"])
        return Reported("llama.cpp", tokens, prompt or body.get("prompt"), settings=settings)
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0].get("logprobs"), dict):
        lp = choices[0]["logprobs"]
        if "content" in lp:
            return Reported("openai-chat", _openai_chat(choices[0]), prompt, request.get("messages"), settings=settings)
        if "tokens" in lp:
            tokens = _openai_completion(choices[0])
            echo = bool(tokens) and tokens[0].logprob is None
            # with echo the tokens already start with the prompt: it must not be fed twice
            return Reported("openai-completions", tokens, None if echo else prompt, echo=echo, settings=settings)
    raise InvalidParameter(
        "response: no logprobs found (expected OpenAI completions or chat logprobs, llama.cpp "
        "completion_probabilities, or an lmtrace trace)"
    )
