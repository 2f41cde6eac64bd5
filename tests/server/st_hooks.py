"""schemathesis hooks for tests/server/test_schemathesis.py, for its positive run only: every
body stays valid by the document (the hooks only lower numbers within their range and drop
optional fields). They keep what the document cannot say out of the run: a prompt plus
`max_tokens` within the model's context (max_tokens lowered to at most 2, which also keeps the
bundled model's run short; /v1/branch's `at` then at most 1), and constraints whose validity
is their own language (a regular expression, a grammar, a JSON schema to compile:
`structured_outputs`, `response_format`, `text`)."""

from __future__ import annotations

import schemathesis

LIMITS = {"max_tokens": 2, "max_completion_tokens": 2, "max_output_tokens": 2, "n": 2}
# the routes' own length field, set when the body leaves it out (chat's default is the rest of
# the context: thousands of tokens on the bundled model)
LENGTH = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/traces": "max_tokens",
    "/v1/branch": "max_tokens",
    "/v1/responses": "max_output_tokens",
}
OWN_LANGUAGE = (
    "structured_outputs",
    "response_format",
    "text",
    "tools",
    "tool_choice",
    "regex",
    "grammar",
    "json_schema",
    "chat_template_kwargs",
)


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict):
        length = LENGTH.get(getattr(ctx.operation, "path", ""))
        if length is not None and body.get(length) is None and body.get("max_completion_tokens") is None:
            body[length] = 2
        at = body.get("at")  # /v1/branch: the step replaced is one of those generated (at < max_tokens)
        if isinstance(at, int) and not isinstance(at, bool) and at > 1:
            body["at"] = 1
        for field, most in LIMITS.items():
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                body[field] = most
        for field in OWN_LANGUAGE:
            body.pop(field, None)
    return body
