"""An OpenAI-compatible server with exact logprobs (raw and sampled), full traces and a live
viewer page. Build the app with `create_app(lm)`; `lmtrace serve` runs it on uvicorn."""

from lmtrace.server.app import create_app
from lmtrace.server.options import ServerOptions

__all__ = ["ServerOptions", "create_app"]
