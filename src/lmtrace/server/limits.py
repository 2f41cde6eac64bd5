"""The body-size limit, in front of every route: a request whose `Content-Length` is over
`--max-body-mb` is answered 413 before any of its body is read; one without a length (chunked)
is counted as it streams in and answered 413 as soon as it passes the limit, so the server
never holds more than the limit of one body in memory."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmtrace.server.errors import APIError

DEFAULT_MAX_BODY_MB = 8


def too_large(limit: int, size: int | None = None) -> APIError:
    mb = limit / (1 << 20)
    most = f"{mb:g} MiB" if limit >= 1 << 20 else f"{limit} bytes"
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"the request body is too large{got}: this server takes at most {most} (lmtrace serve --max-body-mb)",
        code="request_too_large",
    )


class BodyLimit:
    """Answers 413 for a body over `limit` bytes, from its Content-Length or while it streams."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            await too_large(self.limit, int(length)).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # FastAPI lets an HTTPException through: our handler answers it
                    raise HTTPException(413, too_large(self.limit).message)
            return message

        await self.app(scope, counted, send)
