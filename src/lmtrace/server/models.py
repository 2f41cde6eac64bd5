"""GET /v1/models and GET /v1/models/{id}: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from lmtrace.server.errors import APIError
from lmtrace.server.generation import ServerState

router = APIRouter()


def _card(state: ServerState) -> dict[str, Any]:
    return {"id": state.name, "object": "model", "created": state.created, "owned_by": "lmtrace"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_card(request.app.state.lmtrace)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.lmtrace
    if model_id != state.name:
        raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
    return _card(state)
