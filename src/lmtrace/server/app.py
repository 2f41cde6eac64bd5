"""The FastAPI app: OpenAI-compatible routes, lmtrace's /v1/traces, and the viewer page.
`create_app(lm)` takes a loaded model, so tests serve a tiny in-process one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from lmtrace import __version__, arguments
from lmtrace.decode import named_observers
from lmtrace.model.lm import LM
from lmtrace.server import (
    chat,
    compiled,
    completions,
    errors,
    extensions,
    metrics,
    models,
    openapi,
    responses,
    tokenization,
    traces,
    viewer,
)
from lmtrace.server.batcher import BatchingWorker
from lmtrace.server.generation import ServerState
from lmtrace.server.length import longest_token
from lmtrace.server.limits import BodyLimit
from lmtrace.server.options import ServerOptions
from lmtrace.server.security import HostCheck, KeyCheck
from lmtrace.server.worker import ModelWorker


def served_name(lm: LM) -> str:
    """The model id clients send: a file or folder's name (never its path), else the source."""
    source = lm.source.removeprefix("bundled:")
    if source != lm.source or Path(source).exists():
        return Path(source).name.removesuffix(".gguf")
    return source


def create_app(lm: LM, options: ServerOptions | None = None, **keywords: Any) -> FastAPI:
    """The server for one loaded model, served as `options` (ServerOptions) or its fields given as
    keywords (a keyword that is none of them is refused in one line naming it). `max_concurrency`
    requests are admitted at once; their rows (a choice of a prompt each) decode together, up to
    `max_batch` rows, a request that arrives joining the running batch at the next step
    (`max_batch` 1: one request at a time, its choices together, the others waiting); more
    requests get 429 with Retry-After. A request that arrives on
    a loopback address must name localhost, 127.0.0.1 or [::1] (or one of `allowed_hosts`,
    say a reverse proxy's name) as its Host; with `api_key` every route but /health needs it.
    With a `draft` (a lmtrace.model.draft.draft_for spec or Draft) every request decodes
    speculatively inside the batch, proposing `draft_tokens` a block (a request's `draft_tokens`
    overrides it; 0: that request without the draft).
    Prompts are prefilled together and share computed beginnings through a prefix cache of at
    most `prefix_cache_bytes` (0: off; with `max_batch` 1 there is none). With `docs` the
    OpenAPI document is served at /openapi.json, browsable at /docs and /redoc. A body over
    `max_body_bytes` is answered 413 before it is read in full; a request of more than
    `max_rows` rows (prompts times `n`) is a 400. `allowed_origins` (vLLM's --allowed-origins;
    none by default) are the web pages' origins that may call the server from a browser (CORS,
    Starlette's CORSMiddleware): their preflights are answered before the key check (a browser
    sends no key with one), the Host check still first; `allowed_methods`, `allowed_headers`
    and `allow_credentials` as vLLM's (credentials never with the origin "*"). `logits_processors`
    ({name: function or "module:function"}, as vLLM v1's --logits-processors) are the processors a
    request may name in its `logits_processors`; `observers` ({name: an lmtrace.Observer class or
    "module:Class"}) the observers it may name in its `observers` (each row a fresh instance). With
    `compile` a request may ask for the compiled decode step (`compile: true`;
    lmtrace.server.compiled: each choice decoded alone between the batch's steps, a one-off compile
    per sampling setting); without it such a request is a 400."""
    o = arguments.options(ServerOptions, options, "create_app", keywords)
    _check_sizes(o.max_batch, o.prefix_cache_bytes, o.max_body_bytes, o.max_rows)
    origins = check_cors(o.allowed_origins, o.allow_credentials)
    draft = o.draft
    if draft is not None:  # a spec ("packed", "layers:N", a path) loaded once, here
        from lmtrace.model.draft import draft_for

        arguments.draft_tokens(o.draft_tokens)
        draft = draft_for(lm, draft)
    if o.max_batch > 1:
        worker: ModelWorker = BatchingWorker(lm, o.max_concurrency, o.max_batch, o.prefix_cache_bytes)
    else:
        worker = ModelWorker(o.max_concurrency)
    name = o.name or served_name(lm)
    state = ServerState(lm, name, worker, draft=draft, draft_tokens=o.draft_tokens, max_rows=o.max_rows)
    state.registered = named_observers.registered_of(o.logits_processors, o.observers)
    state.compile = o.compile and compiled.allowed(lm, draft)  # checked now, not at each request
    longest_token(state.front.tokenizer)  # the length bound, computed now rather than in the first request

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.worker.shutdown()

    schema, page, redoc = ("/openapi.json", "/docs", "/redoc") if o.docs else (None, None, None)
    app = FastAPI(
        title="lmtrace", version=__version__, lifespan=lifespan, openapi_url=schema, docs_url=page, redoc_url=redoc
    )
    app.state.lmtrace = state
    errors.install(app)
    for module in (models, completions, chat, responses, traces, extensions, tokenization, viewer, metrics):
        app.include_router(module.router)
    openapi.install(app, keyed=bool(o.api_key))

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    cors = {
        "allow_origins": origins,
        "allow_methods": list(o.allowed_methods),
        "allow_headers": list(o.allowed_headers),
        "allow_credentials": o.allow_credentials,
    }
    guard(app, o.api_key, o.allowed_hosts, o.max_body_bytes, cors)
    return app


def _check_sizes(max_batch: int, prefix_cache_bytes: int, max_body_bytes: int, max_rows: int) -> None:
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if prefix_cache_bytes < 0:
        raise ValueError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}")
    if max_body_bytes < 1 or max_rows < 1:
        raise ValueError(f"max_body_bytes and max_rows must be >= 1, got {max_body_bytes} and {max_rows}")


def guard(app: FastAPI, api_key: str | None, hosts: Iterable[str], max_body_bytes: int, cors: dict) -> None:
    """The ASGI guards, in the order a request meets them (the one added last runs first): the
    Host check, CORS (where origins are allowed: a preflight carries no key, so it comes before
    the key check), the key check, the body limit (no body read without the key)."""
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(KeyCheck, key=api_key)
    if cors["allow_origins"]:
        app.add_middleware(CORSMiddleware, **cors)
    app.add_middleware(HostCheck, allowed=hosts)


def check_cors(origins: Iterable[str], allow_credentials: bool) -> list[str]:
    """The allowed origins as a list; credentials with any origin ("*") are refused: a page of
    any site could then act with the browser's credentials for this server."""
    out = list(origins)
    if allow_credentials and "*" in out:
        raise ValueError("allow_credentials cannot be combined with the origin '*': name the origins")
    return out
