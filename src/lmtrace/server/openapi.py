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
MAX_SEED = 2**64 - 1
# the value rules the server checks past pydantic's types (SamplingParams, prepare.py), said in
# the document so that a request valid by the document is one the server takes
RULES: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "presence_penalty": {"enum": [0]},
    "frequency_penalty": {"enum": [0]},
    "n": {"minimum": 1, "maximum": 16},
    "seed": {"minimum": 0, "maximum": MAX_SEED},
    "logprobs": {"minimum": 0, "maximum": 20},
    "draft_tokens": {"minimum": 0, "maximum": 16},
    "best_of": {"enum": [1]},
    "stop": {"minLength": 1, "maxItems": 4},
    "messages": {"minItems": 1},
    "stride": {"minimum": 1},
    "choice": {"minLength": 1, "minItems": 2},
}
PER_SCHEMA: dict[str, dict[str, dict[str, Any]]] = {
    "ChatRequest": {"top_logprobs": {"minimum": 0, "maximum": 20}},
    "ResponsesRequest": {"top_logprobs": {"minimum": 0, "maximum": 20}},
    "TraceRequest": {"top_logprobs": {"minimum": 0, "maximum": 100}, "n": {"enum": [1]}},
    "ScoreRequest": {"top_logprobs": {"minimum": 0, "maximum": 100}, "text": {"minLength": 1},
                     "continuation": {"minLength": 1}},
    "BranchRequest": {"top_logprobs": {"minimum": 0, "maximum": 100}, "prompt": {"minLength": 1},
                      "at": {"minimum": 0}},
}  # fmt: skip


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


def _one_of(given: list[str], absent: list[str]) -> dict[str, Any]:
    """The request gives every field of `given` and none of `absent` (or them as null)."""
    props = {k: {"type": "null"} for k in absent}
    return {"required": given, "properties": {**props, **{k: {"not": {"type": "null"}} for k in given}}}


# rules between fields: top_logprobs only with logprobs true; traces take prompt or messages; a
# score takes text, or prompt with continuation
_TOP_NEEDS_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
TOGETHER: dict[str, dict[str, Any]] = {
    "ChatRequest": _TOP_NEEDS_LOGPROBS,
    "TokenizeRequest": {
        "oneOf": [_one_of(["prompt"], ["messages"]), _one_of(["messages"], ["prompt"])],
        "not": {
            "required": ["add_generation_prompt", "continue_final_message"],
            "properties": {"add_generation_prompt": {"const": True}, "continue_final_message": {"const": True}},
        },
    },
    "TraceRequest": {
        "oneOf": [_one_of(["prompt"], ["messages", "tools", "tool_choice", "chat_template_kwargs"]),
                  _one_of(["messages"], ["prompt"])]
    },  # fmt: skip
    "ScoreRequest": {
        "oneOf": [_one_of(["text"], ["prompt", "continuation"]), _one_of(["prompt", "continuation"], ["text"])]
    },  # fmt: skip
}


def _apply(schema: dict[str, Any], rule: dict[str, Any]) -> None:
    """The rule on each branch of the property that can hold it (a string's length, an
    array's items, a number's range), never on its null."""
    branches = schema.get("anyOf", [schema])
    for b in branches:
        kind = b.get("type")
        for key, value in rule.items():
            if key in ("minimum", "maximum", "exclusiveMinimum", "enum") and kind in ("integer", "number"):
                b[key] = value
            elif key == "minLength" and kind == "string":
                b[key] = value
            elif key == "minLength" and kind == "array" and b.get("items", {}).get("type") == "string":
                b["items"][key] = value
            elif key in ("maxItems", "minItems") and kind == "array":
                b[key] = value


def prompt_schema(vocab: int) -> dict[str, Any]:
    """OpenAI's four prompt shapes, each non-empty, token ids in the vocabulary."""
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}, "minItems": 1}
    many = {"type": "array", "items": {"anyOf": [text, ids]}, "minItems": 1, "maxItems": 256}
    return {"anyOf": [text, ids, many]}


def below(n: int) -> str:
    """A regular expression of the decimal integers 0 to n - 1 (no leading zeros), n >= 1."""
    top = str(n - 1)
    shorter = [f"[1-9][0-9]{{{k - 1}}}" if k > 1 else "[0-9]" for k in range(1, len(top))]
    same = []  # numbers of top's length: a smaller digit at position i after top's first i digits
    for i, d in enumerate(top):
        low = "1" if i == 0 and len(top) > 1 else "0"
        if int(d) > int(low):
            rest = f"[0-9]{{{len(top) - i - 1}}}" if i < len(top) - 1 else ""
            same.append(f"{top[:i]}[{low}-{int(d) - 1}]{rest}")
    return "^(" + "|".join([*shorter, *same, top]) + ")$"


def logit_bias_schema(vocab: int) -> dict[str, Any]:
    """logit_bias: token ids of the vocabulary (as JSON keys) to biases in [-100, 100]."""
    bias = {"type": "number", "minimum": -100, "maximum": 100}
    table = {"type": "object", "propertyNames": {"pattern": below(vocab)}, "additionalProperties": bias}
    return {"anyOf": [table, {"type": "null"}], "title": "Logit Bias"}


def tighten(schemas: dict[str, Any], context: int | None, vocab: int, draft: bool) -> None:
    """The request schemas with the server's value rules (RULES) and the model's sizes."""
    for name, schema in schemas.items():
        props = schema.get("properties", {})
        rules = {**RULES, **PER_SCHEMA.get(name, {})}
        if context:
            for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                rules[field] = {"minimum": 1, "maximum": context}
            rules["window"] = {"minimum": 2, "maximum": context}
        if not draft and "draft_tokens" in props:  # a server without --draft takes none
            props["draft_tokens"] = {"type": "null", "title": "Draft Tokens"}
        for field, rule in rules.items():
            if field in props:
                _apply(props[field], rule)
        if "logit_bias" in props:
            props["logit_bias"] = logit_bias_schema(vocab)
        if name in ("CompletionRequest", "TraceRequest") and "prompt" in props:
            props["prompt"] = {**prompt_schema(vocab), "title": "Prompt"}
        for field in ("suffix", "previous_response_id", "encrypted_content"):  # accepted only at null
            if field in props:
                props[field] = {"type": "null", "title": props[field].get("title", field)}
        if "background" in props:  # no background mode: false or null only
            props["background"] = {"anyOf": [{"const": False}, {"type": "null"}], "title": "Background"}
        schema.update(TOGETHER.get(name, {}))
    ids = schemas.get("DetokenizeRequest", {}).get("properties", {}).get("tokens")
    if ids is not None:
        ids["items"] = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    attention = schemas.get("BranchRequest", {}).get("properties", {}).get("attention")
    if attention is not None:
        attention["anyOf"] = [{"type": "boolean"}, {"enum": ["heads"]}]


def document(app: FastAPI, keyed: bool) -> dict[str, Any]:
    """The app's OpenAPI document, its error answers the server's own."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in FASTAPI_OWN:
        schemas.pop(name, None)
    schemas["Error"] = ERROR_SCHEMA
    state = app.state.lmtrace
    config = state.lm.model.config
    tighten(schemas, getattr(config, "max_position_embeddings", None), int(config.vocab_size), state.draft is not None)
    if not state.compile:  # a server without --compile takes `compile: false` only (lmtrace.server.compiled)
        for schema in schemas.values():
            if "compile" in schema.get("properties", {}):
                schema["properties"]["compile"] = {"const": False, "default": False, "title": "Compile"}
    for path in doc.get("paths", {}).values():
        for operation in path.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            name = body.get("$ref", "").rsplit("/", 1)[-1]
            if "stream" in schemas.get(name, {}).get("properties", {}):  # stream: true answers events
                ok = responses.setdefault("200", {"description": "The answer"}).setdefault("content", {})
                ok["text/event-stream"] = {"schema": {}}  # each event's data: a chunk, then [DONE]
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
