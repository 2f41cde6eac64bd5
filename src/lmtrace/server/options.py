"""How `create_app` serves a model, as one object: `ServerOptions`. `create_app(lm, **keywords)`
builds it from the keywords a caller has always passed; `create_app(lm, options)` takes it whole.

    app = create_app(lm, max_batch=16, api_key="secret")
    app = create_app(lm, ServerOptions(max_batch=16, api_key="secret"))"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lmtrace.server.lane import DEFAULT_PREFIX_CACHE_BYTES
from lmtrace.server.limits import DEFAULT_MAX_BODY_MB
from lmtrace.server.prepare import DEFAULT_MAX_ROWS

DEFAULT_MAX_CONCURRENCY = 16
DEFAULT_MAX_BATCH = 16


@dataclass(frozen=True)
class ServerOptions:
    """Everything `create_app` takes besides the model. `name`: the model id clients send (None:
    the file or folder's name). `max_concurrency` requests are admitted at once (more get 429),
    their rows decoding together up to `max_batch` rows (1: one request at a time). A request on a
    loopback address must name localhost (or one of `allowed_hosts`) as its Host; with `api_key`
    every route but /health needs it. `draft` (a lmtrace.model.draft.draft_for spec or Draft)
    decodes every request speculatively, `draft_tokens` a block. `prefix_cache_bytes`: the prefix
    cache's size (0: off). `docs`: the OpenAPI document at /openapi.json, /docs and /redoc. A body
    over `max_body_bytes` is a 413, a request of more than `max_rows` rows a 400. `allowed_origins`,
    `allowed_methods`, `allowed_headers`, `allow_credentials`: CORS, as vLLM's options.
    `logits_processors` ({name: function or "module:function"}): the processors a request may
    name; `observers` ({name: an lmtrace.Observer class or "module:Class"}): the observers a
    request may name (each row a fresh instance). `compile`: requests may ask for the compiled
    decode step (lmtrace.server.compiled)."""

    name: str | None = None
    api_key: str | None = None
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    allowed_hosts: Iterable[str] = ()
    max_batch: int = DEFAULT_MAX_BATCH
    draft: Any = None
    draft_tokens: int | str = 4  # or "auto" (lmtrace.decode.block_size)
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    docs: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20
    max_rows: int = DEFAULT_MAX_ROWS
    allowed_origins: Iterable[str] = ()
    allowed_methods: Iterable[str] = ("*",)
    allowed_headers: Iterable[str] = ("*",)
    allow_credentials: bool = False
    logits_processors: Mapping[str, Any] | None = None
    observers: Mapping[str, Any] | None = None
    compile: bool = False
