"""Routes whose JSON is read and written in a worker thread, never on the event loop. FastAPI
parses a request body (`json.loads`, a C call that holds the interpreter: tens of ms for a body of
several MB) and encodes a returned dict (`jsonable_encoder`, over a second for an answer of a
million numbers: 1,024 rows with top-20 logprobs, or /tokenize's ids of a 5 MB prompt) on the
event loop, where every other request and /health wait for it. `ThreadedRoute` (FastAPI's own
pattern for a custom route class) parses the body in a thread and encodes the answer there with
the Python encoder, which lets the loop run between its pieces (the C one would hold it)."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

# what Starlette's JSONResponse writes, by the Python encoder; anything else through FastAPI's
ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=jsonable_encoder)


def encoded(content: Any) -> Response:
    """`content` as a JSON answer, written piece by piece (run it in a thread)."""
    return Response("".join(ENCODER.iterencode(content)).encode("utf-8"), media_type="application/json")


class ThreadedRequest(Request):
    """The request as FastAPI's handler sees it: the body read through the original request
    (so that an error handler given that one still finds it), its JSON parsed in a thread."""

    def __init__(self, outer: Request):
        super().__init__(outer.scope, outer.receive)
        self.outer = outer

    async def body(self) -> bytes:
        return await self.outer.body()

    async def json(self) -> Any:
        return await run_in_threadpool(json.loads, await self.body())


def answered_in_thread(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """The endpoint with its returned dict or list encoded in a thread (a Response as it is);
    a plain function runs in a thread too, as FastAPI runs it."""

    @functools.wraps(endpoint)  # FastAPI reads the parameters through __wrapped__
    async def answered(*args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(endpoint):
            result = await endpoint(*args, **kwargs)
        else:
            result = await run_in_threadpool(endpoint, *args, **kwargs)
        if isinstance(result, Response):
            return result
        return await run_in_threadpool(encoded, result)

    return answered


class ThreadedRoute(APIRoute):
    """An APIRoute whose body is parsed and whose answer is encoded off the event loop."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any):
        super().__init__(path, answered_in_thread(endpoint), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(ThreadedRequest(request))

        return route
