"""The audit's tests use the server tests' tiny chat model and their real uvicorn server."""

from tests.server.conftest import chat_lm  # noqa: F401  (a fixture)
