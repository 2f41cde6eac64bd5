"""GET /: the viewer page. One self-contained file (inline CSS and JS, no external requests,
enforced by its Content-Security-Policy) that streams POST /v1/traces and colours each token
by its probability. Model text is inserted with textContent only, never as HTML."""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@lru_cache(maxsize=1)
def page() -> str:
    return files("lmtrace.server").joinpath("viewer.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def viewer() -> HTMLResponse:
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
    return HTMLResponse(page(), headers=headers)
