"""The OpenAPI document served at /openapi.json (with /docs and /redoc), as the server really
answers: FastAPI's default 422 "validation error" replaced by the statuses the server gives,
each with OpenAI's error envelope, so a tool pointed at the document (schemathesis, a client
generator) knows every answer it can get."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's error envelope",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}

WHY = {
    "400": "A bad request: a field's value, a missing or unknown field, a body that is not JSON",
    "401": "A missing or wrong API key",
    "404": "An unknown model (`model` names another one)",
    "413": "A body over the server's limit (lmtrace serve --max-body-mb)",
    "429": "Every admission slot is taken; retry after `Retry-After` seconds",
    "503": "The server is shutting down",
}
FASTAPI_OWN = ("HTTPValidationError", "ValidationError")


def _error(status: str) -> dict[str, Any]:
    return {
        "description": WHY[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def statuses(operation: dict[str, Any], keyed: bool) -> list[str]:
    """The error statuses an operation can answer: every route with a body can be a bad request,
    too large, an unknown model, busy or cancelled by the shutdown."""
    out = ["401"] if keyed else []
    if "requestBody" in operation:
        out += ["400", "404", "413", "429", "503"]
    elif operation.get("parameters"):
        out += ["404"]
    return out


def document(app: FastAPI, keyed: bool) -> dict[str, Any]:
    """The app's OpenAPI document, its error answers the server's own."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in FASTAPI_OWN:
        schemas.pop(name, None)
    schemas["Error"] = ERROR_SCHEMA
    for path in doc.get("paths", {}).values():
        for operation in path.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in statuses(operation, keyed):
                responses.setdefault(status, _error(status))
    return doc


def install(app: FastAPI, keyed: bool) -> None:
    """Serves `document(app)` (built once, at the first request for it)."""
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not built:
            built.update(document(app, keyed))
        return built

    app.openapi = openapi  # type: ignore[method-assign]
