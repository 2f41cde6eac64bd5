"""Connecting to the server under audit, before the model is loaded (no torch here): the server
answers, takes the key, serves the model asked for; and the audit's own arguments checked."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lmtrace.comparison.audit.client import DEFAULT_TIMEOUT, Client, HTTPFailure, Unreachable, base_url
from lmtrace.errors import InvalidParameter

PROBE_NAMES = (
    "logprobs",
    "echo",
    "top_logprobs",
    "streaming",
    "prompts",
    "repeat",
    "concurrency",
    "usage",
    "stop",
    "chat",
    "bytes",
    "tokenize",
)
DEFAULT_TOLERANCE = 0.01  # nats: float32 kernels agree to ~1e-4; a bfloat16 server needs ~0.2
MAX_TOKENS = 12


def refused_key(url: str, api_key: str | None, e: HTTPFailure) -> InvalidParameter:
    if api_key:
        return InvalidParameter(f"api-key: {url} refused the key (HTTP {e.status}: {e.message()})")
    return InvalidParameter(f"api-key: {url} needs an API key (HTTP {e.status}: {e.message()}); pass --api-key")


@dataclass
class Server:
    """A server that answered: its client, the model id the audit names, and all it serves."""

    client: Client
    served: str
    models: list[str]


def check_probes(probes: Sequence[str] | None) -> list[str]:
    if not probes:
        return list(PROBE_NAMES)
    unknown = [p for p in probes if p not in PROBE_NAMES]
    if unknown:
        raise InvalidParameter(f"probe: unknown {unknown[0]!r} (one of: {', '.join(PROBE_NAMES)})")
    return list(dict.fromkeys(probes))


def check_tolerance(tolerance: float) -> float:
    if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance <= 0:
        raise InvalidParameter(f"tolerance must be a number > 0 (nats), got {tolerance!r}")
    return float(tolerance)


def connect(
    url: str, *, api_key: str | None = None, served_model: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> Server:
    """GET /v1/models: the server is reachable, takes the key, and serves `served_model` (by
    default the first model it lists). Raises InvalidParameter naming what is wrong."""
    client = Client(base_url(url), api_key, timeout)
    try:
        listing = client.get("/v1/models")
    except Unreachable as e:
        raise InvalidParameter(f"url: cannot reach {url} ({e})") from None
    except HTTPFailure as e:
        if e.status in (401, 403):
            raise refused_key(url, api_key, e) from None
        if e.status == 404:
            raise InvalidParameter(f"url: {url} has no /v1/models: is it an OpenAI-compatible server?") from None
        raise InvalidParameter(f"url: GET {url}/v1/models answered HTTP {e.status}: {e.message()}") from None
    data = listing.get("data") if isinstance(listing, dict) else None
    models = [m.get("id") for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if served_model is not None and served_model not in models:
        raise InvalidParameter(
            f"served-model: {url} does not serve {served_model!r} (it serves: {', '.join(models) or 'nothing'})"
        )
    if not models and served_model is None:
        raise InvalidParameter(f"url: {url}/v1/models lists no model; name one with --served-model")
    return Server(client, served_model or models[0], models)
