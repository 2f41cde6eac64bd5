"""`--server URL` (or LMTRACE_SERVER) on generate, score, branch and cache: the work runs on a
live `lmtrace serve` (/v1/traces, /v1/score, /v1/branch) and its answer is rendered here, so a
command costs no torch import and no model load: the same records, the same views. Only the
standard library talks to the server; LMTRACE_API_KEY is sent as the bearer key when set."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import click

from lmtrace.comparison.audit.client import event_data
from lmtrace.errors import InvalidParameter, LmtraceError
from lmtrace.params import SamplingParams

TIMEOUT_S = 600  # a long generation answers late; an unreachable server fails at once


def server_option(f: Callable) -> Callable:
    """Adds --server URL (default $LMTRACE_SERVER)."""
    return click.option("--server", default=None, envvar="LMTRACE_SERVER", metavar="URL",
                        help="Run on this live `lmtrace serve` instead of loading the model here "
                             "(default $LMTRACE_SERVER).")(f)  # fmt: skip


def check(server: str, model: str | None, local: dict[str, Any]) -> str:
    """The server's base URL; options that only make sense for a local model are refused (they
    would be silently ignored)."""
    url = urlparse(server)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise InvalidParameter(f"server: expected an http:// or https:// URL, got {server!r}")
    for name, value in local.items():
        if value not in (None, False, "auto", "float", "default", ()):
            flag = name.replace("_", "-")
            raise InvalidParameter(f"{flag}: --{flag} applies to a model loaded here; drop it with --server {server}")
    return server.rstrip("/")


def _request(base: str, path: str, body: dict[str, Any]) -> Any:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if os.environ.get("LMTRACE_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['LMTRACE_API_KEY']}"
    data = json.dumps(body).encode("utf-8")
    request = urllib.request.Request(base + path, data=data, headers=headers, method="POST")
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 (the URL's scheme is checked)
    except urllib.error.HTTPError as e:
        raise _answer(base, e) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise LmtraceError(f"server: cannot reach {base} ({reason}); is `lmtrace serve` running there?") from None


def _answer(base: str, e: urllib.error.HTTPError) -> LmtraceError:
    """The server's error envelope as one line: its own message (bad input: exit 2)."""
    try:
        error = json.loads(e.read().decode("utf-8"))["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": f"HTTP {e.code} {e.reason}"}
    if error.get("code") == "model_not_found":
        return InvalidParameter(f"model: {error['message']} ({base}); drop --model, or serve that model")
    if e.code == 404:
        return LmtraceError(f"server: {base} is not an lmtrace server (no {e.url and urlparse(e.url).path} route)")
    text = f"server: {error.get('message')}" if error.get("param") is None else str(error.get("message"))
    return InvalidParameter(text) if e.code in (400, 422) else LmtraceError(f"{text} (HTTP {e.code} from {base})")


def post(base: str, path: str, body: dict[str, Any]) -> Any:
    """POSTs `body` and returns the JSON answer."""
    with _request(base, path, body) as response:
        return json.loads(response.read().decode("utf-8"))


def events(base: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POSTs a streaming request and yields each server-sent event's JSON until [DONE]."""
    with _request(base, path, {**body, "stream": True}) as response:
        for data in event_data(response):
            event = json.loads(data)
            if "error" in event:
                raise LmtraceError(f"server: {event['error'].get('message')}")
            yield event


def sampling(params: SamplingParams) -> dict[str, Any]:
    """The request fields of the sampling options (OpenAI's names, lmtrace's extensions)."""
    out = {"max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
           "top_k": params.top_k, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
           "seed": params.seed, "stop": list(params.stop) or None, "top_logprobs": params.top_logprobs,
           **({} if params.stop_on_eos else {"ignore_eos": True})}  # fmt: skip
    if params.logit_bias:  # only when given: a server before logit_bias refuses the field
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return out


def served(model: str | None) -> dict[str, Any]:
    """`model` as the server names it (a file or folder's name, never its path), when given."""
    if model is None:
        return {}
    from pathlib import PurePath

    from lmtrace.arguments import looks_like_path

    return {"model": PurePath(model).name.removesuffix(".gguf") if looks_like_path(model) else model}


def trace(base: str, model: str | None, text: str, params: SamplingParams, chat: bool, inside: dict[str, Any],
          on_step: Callable[[dict[str, Any]], None]) -> dict[str, Any]:  # fmt: skip
    """A trace of `text` made by the server (streamed: `on_step` sees each step as it comes)."""
    prompt = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body = {**served(model), **prompt, **sampling(params), **inside}
    found = None
    for event in events(base, "/v1/traces", body):
        if event.get("object") == "trace.step":
            on_step(event["step"])
        elif event.get("object") == "trace":
            found = event["trace"]
    if found is None:
        raise LmtraceError(f"server: {base} ended the stream without a trace")
    return found


class Answer:
    """A score result or branches as the server answered them, for the torch-free renderers:
    attribute access as the library's result, `to_dict()` / `to_json()` as the answer itself."""

    def __init__(self, d: dict[str, Any]):
        from lmtrace.records import TokenScore, Trace

        self._d = d
        self.__dict__.update({k: v for k, v in d.items() if k not in ("tokens", "branches")})
        if isinstance(d.get("tokens"), list):
            self.tokens = [TokenScore.from_dict(t) for t in d["tokens"]]
        if isinstance(d.get("branches"), list):
            self.traces = [Trace.from_dict(t) for t in d["branches"]]

    def to_dict(self) -> dict[str, Any]:
        return self._d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self._d, ensure_ascii=False, indent=indent, allow_nan=False)


def score(base: str, model: str | None, fields: dict[str, Any]) -> Answer:
    """A score result made by the server (POST /v1/score)."""
    return Answer(post(base, "/v1/score", {**served(model), **{k: v for k, v in fields.items() if v is not None}}))


def branch(base: str, model: str | None, fields: dict[str, Any], params: SamplingParams) -> Answer:
    """Branches made by the server (POST /v1/branch)."""
    return Answer(post(base, "/v1/branch", {**served(model), **sampling(params), **fields}))
