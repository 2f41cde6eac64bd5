"""OpenAI's error envelope, {"error": {"message", "type", "param", "code"}}, for every failure:
bad requests (400), a wrong key (401), an unknown model or route (404), a method the route does
not take (405, with `Allow`), a body over the limit (413), a full queue (429), a request
cancelled by the server's shutdown (503). Pydantic's errors are said in OpenAI's words: a field
as `messages[0].content` in the message and `messages.[0].content` in `param`, never a
validator's internal name."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmtrace.errors import InvalidParameter, LmtraceError
from lmtrace.server.worker import ShuttingDown

log = logging.getLogger("lmtrace.server")

# SamplingParams speaks lmtrace's names; the API speaks OpenAI's.
API_NAMES = {"max_new_tokens": "max_tokens"}
_LEADING_NAME = re.compile(r"^([a-z_]+)\b")
# a step of a pydantic location that names a validator or a union member, not a field
_INTERNAL = re.compile(r"[\[\](),]|^(str|int|float|bool|list|dict|none|tagged-union|literal)$")
MAX_JSON_DEPTH = 512  # arrays and objects nested in a request body (no request field needs 20)
PARSE_FAILED = "There was an error parsing the body"  # FastAPI's words
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


def field_path(loc: tuple | list, dotted: bool) -> str:
    """A pydantic location as OpenAI writes it: `messages[0].role` (messages) or
    `messages.[0].role` (`param`); validator and union-member names left out."""
    out = ""
    for p in loc:
        if p == "body" and not out:
            continue
        if isinstance(p, int):
            out += f".[{p}]" if dotted and out else f"[{p}]"
        elif not _INTERNAL.search(str(p)):
            out += f".{p}" if out else str(p)
    return out


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {}
    kind = first.get("type", "")
    loc = first.get("loc", ())
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON ({first.get('msg', 'parse error')})")
    where, param = field_path(loc, False), field_path(loc, True) or None
    if kind == "missing":
        if not where:  # no body at all
            return bad_request("the request body is required: a JSON object")
        return bad_request(f"{where} is required", param)
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {where}", param)
    if kind == "string_unicode":  # a lone surrogate in a field name (pydantic cannot read it)
        return bad_request(f"{where or 'the request body'}: a string is not valid Unicode (a lone surrogate)", param)
    if not where:  # the body itself has the wrong type (an array, a string)
        return bad_request("the request body must be a JSON object")
    value = json.dumps(first.get("input"), ensure_ascii=False, default=str)[:80]
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if msg.startswith("must "):  # our own validators' words: "max_tokens must be an integer"
        return bad_request(f"{where} {msg}, got {value}", param)
    return bad_request(f"{where}: {msg}, got {value}", param)


def depth(text: str) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings not counted)."""
    deepest = level = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    return deepest


def unreadable_body(body: bytes) -> APIError:
    """Why a body could not be read as JSON (FastAPI says only "There was an error parsing the
    body"), in one line."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return bad_request(f"the request body is not UTF-8 text (byte {e.start} is {body[e.start]:#04x})")
    nested = depth(text)
    if nested > MAX_JSON_DEPTH:
        return bad_request(f"the request body nests {nested} levels deep; at most {MAX_JSON_DEPTH} are read")
    try:
        json.loads(text)
    except (ValueError, RecursionError) as e:
        return bad_request(f"the request body is not valid JSON ({' '.join(str(e).split())[:200]})")
    return bad_request("the request body could not be read as JSON")


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
        if exc.status_code == 400 and exc.detail == PARSE_FAILED:
            # (reading an 8 MB body's depth in Python would hold the event loop for seconds)
            return (await run_in_threadpool(unreadable_body, await request.body())).response()
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; it takes {allowed or 'none'}"
            return APIError(405, message, headers=exc.headers).response()
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else exc.detail
        code = "request_too_large" if exc.status_code == 413 else None
        return APIError(exc.status_code, str(message), code=code, headers=exc.headers).response()

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
