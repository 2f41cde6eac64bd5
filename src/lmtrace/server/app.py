"""The FastAPI app: OpenAI-compatible routes, lmtrace's /v1/traces, and the viewer page.
`create_app(lm)` takes a loaded model, so tests serve a tiny in-process one."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from lmtrace.loading import LM
from lmtrace.server import chat, completions, errors, models, traces, viewer
from lmtrace.server.errors import APIError
from lmtrace.server.generation import ServerState
from lmtrace.server.worker import ModelWorker

DEFAULT_MAX_CONCURRENCY = 16


def served_name(lm: LM) -> str:
    """The model id clients send: a file or folder's name (never its path), else the source."""
    source = lm.source.removeprefix("bundled:")
    if source != lm.source or Path(source).exists():
        return Path(source).name.removesuffix(".gguf")
    return source


class KeyCheck:
    """With an API key set, every /v1/ request needs `Authorization: Bearer KEY`. Checked
    before the body is read; compared in constant time; the key is never logged."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self._allowed(scope):
            err = APIError(401, "Incorrect or missing API key: send Authorization: Bearer KEY", code="invalid_api_key")
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def create_app(
    lm: LM,
    *,
    name: str | None = None,
    api_key: str | None = None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
) -> FastAPI:
    """The server for one loaded model. `max_concurrency` requests are admitted at once (one
    generating, the others waiting); more get 429 with Retry-After."""
    state = ServerState(lm, name or served_name(lm), ModelWorker(max_concurrency))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.worker.shutdown()

    app = FastAPI(title="lmtrace", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lmtrace = state
    errors.install(app)
    for module in (models, completions, chat, traces, viewer):
        app.include_router(module.router)
    if api_key:
        app.add_middleware(KeyCheck, key=api_key)
    return app
