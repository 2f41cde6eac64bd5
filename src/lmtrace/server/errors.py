"""OpenAI's error envelope, {"error": {"message", "type", "param", "code"}}, for every failure:
bad requests (400), a wrong key (401), an unknown model or route (404), a full queue (429),
a request cancelled by the server's shutdown (503)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmtrace.errors import InvalidParameter, LmtraceError
from lmtrace.server.worker import ShuttingDown

log = logging.getLogger("lmtrace.server")

# SamplingParams speaks lmtrace's names; the API speaks OpenAI's.
API_NAMES = {"max_new_tokens": "max_tokens"}
_LEADING_NAME = re.compile(r"^([a-z_]+)\b")
# a lone surrogate (JSON allows "\ud800") cannot be encoded as UTF-8: one echoed back in a
# message would make the error answer itself fail
_SURROGATE = re.compile("[\ud800-\udfff]")


def printable(text: str) -> str:
    """The text with every lone surrogate replaced by U+FFFD, so that it can be sent."""
    return _SURROGATE.sub("\ufffd", text)


class APIError(Exception):
    """An error answered with the envelope; `param` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        message, param = printable(message), None if param is None else printable(param)
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_invalid(e: InvalidParameter, renames: dict[str, str] | None = None) -> APIError:
    """InvalidParameter's message starts with the parameter's name: that is the `param`,
    renamed to the request field that set it."""
    names = {**API_NAMES, **(renames or {})}
    message = str(e)
    m = _LEADING_NAME.match(message)
    name = m.group(1) if m else None
    if name in names:
        message = names[name] + message[len(name) :]
        name = names[name]
    return bad_request(message, name)


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {}
    kind = first.get("type", "")
    # OpenAI writes a nested field as messages.[0].role
    loc = [f"[{p}]" if isinstance(p, int) else str(p) for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON ({first.get('msg', 'parse error')})")
    param = ".".join(loc) or None
    if kind == "missing":
        return bad_request(f"{param} is required", param)
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind == "string_unicode":  # a lone surrogate in a field name (pydantic cannot read it)
        return bad_request(f"{param or 'the request body'}: a string is not valid Unicode (a lone surrogate)", param)
    if not loc:  # the body itself has the wrong type (an array, a string)
        return bad_request("the request body must be a JSON object")
    value = json.dumps(first.get("input"), ensure_ascii=False, default=str)[:80]
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}, got {value}", param)


def install(app: FastAPI) -> None:
    """Routes every error through the envelope."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(InvalidParameter)
    async def _param(request: Request, exc: InvalidParameter) -> JSONResponse:
        return from_invalid(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return APIError(exc.status_code, str(message)).response()

    @app.exception_handler(Exception)
    async def _failure(request: Request, exc: Exception) -> JSONResponse:
        return failure(exc).response()


def failure(exc: BaseException) -> APIError:
    """A failure while running: logged in full, answered without internals (no paths)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameter):
        return from_invalid(exc)
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), type="server_error", code="server_shutting_down")
    log.error("generation failed", exc_info=exc)
    what = "the model failed while generating" if isinstance(exc, LmtraceError) else "internal error"
    return APIError(500, f"{what} ({type(exc).__name__})", type="server_error")
