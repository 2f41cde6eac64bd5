"""Two ASGI guards in front of the app.

HostCheck: a request that arrived on a loopback address must name a loopback host
(localhost, 127.0.0.1 or [::1], with the server's port) in its Host header. A web page can
make a browser resolve its own domain to 127.0.0.1 (DNS rebinding) and then read this server
as if it were the same origin; such requests still carry the page's domain as their Host,
and are answered 421.

KeyCheck: with an API key, every route but GET /health needs it, as `Authorization: Bearer
KEY` or, for a browser opening the viewer page, HTTP Basic with the key as the password."""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from lmtrace.server.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
PUBLIC_PATHS = frozenset({"/health"})  # answered without the key: says only that the server is up


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value
    return None


def split_host(host: str) -> tuple[str, int | None] | None:
    """("name", port or None) of a Host header, the name lowercased; None when malformed."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal: [::1]:8000
        name, sep, rest = host.partition("]")
        name += sep
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    else:
        name, sep, port = host.partition(":")
        port = port if sep else None
    if not name or (port is not None and not (port.isdigit() and len(port) <= 5)):
        return None
    return name, None if port is None else int(port)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class HostCheck:
    """Refuses a request that arrived on a loopback address unless its Host names loopback
    (or one of `allowed`, any port: a reverse proxy's public name)."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str] = ()):
        self.app = app
        self.allowed = frozenset(h.lower() for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server") if scope["type"] == "http" else None  # no websocket routes
        if server and _is_loopback(str(server[0])) and not self._allowed(scope, server[1]):
            err = APIError(
                421,
                "the Host header must name this server as localhost, 127.0.0.1 or [::1] with its port "
                "(a request through another name may come from a web page: DNS rebinding)",
                code="invalid_host",
            )
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope, port: int | None) -> bool:
        raw = _header(scope, b"host")
        parsed = split_host(raw.decode("latin-1")) if raw is not None else None
        if parsed is None:
            return False
        name, given = parsed
        if name in self.allowed:
            return True
        # no port in the Host header means the scheme's default
        return name in LOOPBACK_NAMES and (given or 80) == port


class KeyCheck:
    """Checked before the body is read; compared in constant time; the key is never logged."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and not self._allowed(scope):
            # a browser asks for the key (as a password) only when it opens a page
            page = not scope["path"].startswith("/v1/")
            challenge = 'Basic realm="lmtrace", charset="UTF-8"' if page else "Bearer"
            err = APIError(
                401,
                "Incorrect or missing API key: send Authorization: Bearer KEY",
                code="invalid_api_key",
                headers={"WWW-Authenticate": challenge},
            )
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        token = token.strip()
        if scheme.lower() == b"basic":
            try:
                token = base64.b64decode(token, validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return False
        elif scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token, self.key)
