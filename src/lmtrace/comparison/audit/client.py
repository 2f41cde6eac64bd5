"""A small HTTP client for the server under audit (the standard library's, so the audit needs
no HTTP package): JSON requests, server-sent event streams, and every exchange kept as
evidence a user can paste into an upstream issue (the key never is)."""

from __future__ import annotations

import json
import shlex
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lmtrace.errors import InvalidParameter

DEFAULT_TIMEOUT = 120.0  # seconds per request: a CPU server decodes slowly
EXCERPT = 2000  # characters of an error body kept


class HTTPFailure(Exception):
    """The server answered with an error status (or something that is not JSON)."""

    def __init__(self, status: int, body: str, request: dict[str, Any]):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body, self.request = status, body[:EXCERPT], request

    def message(self) -> str:
        """The server's own error message when it sent one in OpenAI's shape, else the body."""
        try:
            data = json.loads(self.body)
            err = data.get("error", data) if isinstance(data, dict) else data
            text = err.get("message", err) if isinstance(err, dict) else err
        except ValueError:
            text = self.body
        return " ".join(str(text).split())[:300]


class Unreachable(Exception):
    """No answer at all: refused, timed out, no such host."""


def base_url(url: str) -> str:
    """The server's root: "http://host:8000/v1/" and "http://host:8000" are the same server."""
    if not url.startswith(("http://", "https://")):
        raise InvalidParameter(f"url must start with http:// or https://, got {url!r}")
    root = url.rstrip("/")
    return root.removesuffix("/v1") if root.endswith("/v1") else root


@dataclass
class Client:
    url: str
    api_key: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    sent: int = field(default=0)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> urllib.request.Request:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        return urllib.request.Request(self.url + path, data=data, headers=headers, method=method)

    def _open(self, method: str, path: str, body: dict[str, Any] | None):
        self.sent += 1
        record = {"method": method, "path": path, "body": body}
        try:
            return urllib.request.urlopen(self._request(method, path, body), timeout=self.timeout)
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", errors="replace")
            raise HTTPFailure(e.code, text, record) from None
        except (TimeoutError, urllib.error.URLError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise Unreachable(f"{method} {path}: {reason}") from None

    def get(self, path: str) -> Any:
        with self._open("GET", path, None) as response:
            return self._json(response.read(), "GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        with self._open("POST", path, body) as response:
            return self._json(response.read(), "POST", path, body)

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The data of each server-sent event up to `data: [DONE]`, in order."""
        with self._open("POST", path, body) as response:
            return [self._json(data.encode("utf-8"), "POST", path, body) for data in event_data(response)]

    def _json(self, data: bytes, method: str, path: str, body: dict[str, Any] | None) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            text = data.decode("utf-8", errors="replace")
            raise HTTPFailure(200, f"not JSON: {text}", {"method": method, "path": path, "body": body}) from None

    def curl(self, path: str, body: dict[str, Any]) -> str:
        """The request as a curl command line (the key as $OPENAI_API_KEY, never its value)."""
        parts = ["curl", "-s", self.url + path, "-H", "Content-Type: application/json"]
        if self.api_key:
            parts += ["-H", "Authorization: Bearer $OPENAI_API_KEY"]
        line = " ".join(shlex.quote(p) for p in parts)
        line = line.replace("'Authorization: Bearer $OPENAI_API_KEY'", '"Authorization: Bearer $OPENAI_API_KEY"')
        return f"{line} -d {shlex.quote(json.dumps(body, ensure_ascii=False))}"


def event_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The `data:` payload of each server-sent event in a response's lines, up to `data: [DONE]`."""
    for raw in lines:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield data
