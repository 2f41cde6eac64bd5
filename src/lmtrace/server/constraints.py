"""Constrained decoding in a request: OpenAI's `response_format` ({"type": "json_schema",
"json_schema": {"name", "schema", "strict"}} or {"type": "json_object"}), vLLM's
`structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object"}), and on
/v1/traces the CLI's own keys (`json_schema`, `regex`, `choice`, `grammar`, `json_whitespace`).
At most one of them; the constraint is compiled here (lmtrace.logits.grammar.check), before the
request waits for the model, so a schema that does not compile is a 400 naming its field.

JSON schemas compile compact (no whitespace between tokens) unless `json_whitespace` is "any"
or `structured_outputs.disable_any_whitespace` is false (vLLM's lenient grammar)."""

from __future__ import annotations

import json
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.logits import grammar
from lmtrace.params import SamplingParams
from lmtrace.server.errors import bad_request, from_invalid
from lmtrace.server.schemas import Sampling

ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object, as vLLM compiles it
OWN_KEYS = ("json_schema", "regex", "choice", "grammar")


def _response_format(body: Sampling) -> dict[str, Any] | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_schema": ANY_OBJECT}
    if rf.json_schema is None:
        raise bad_request("response_format.json_schema is required with type json_schema", "response_format")
    return {"json_schema": rf.json_schema.schema_}


def _structured(body: Sampling) -> dict[str, Any] | None:
    so = body.structured_outputs
    if so is None:
        return None
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar), ("json_object", so.json_object)) if v}  # fmt: skip
    if len(given) != 1:
        names = " and ".join(given) or "none"
        raise bad_request(f"structured_outputs takes one of json, regex, choice, grammar, json_object; got {names}",
                          "structured_outputs")  # fmt: skip
    (key, value), = given.items()
    out: dict[str, Any]
    if key in ("json", "json_object"):
        schema = ANY_OBJECT if key == "json_object" else value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise bad_request(f"structured_outputs.json is not JSON ({e})", "structured_outputs.json") from e
        out = {"json_schema": schema}
        if so.disable_any_whitespace is False:
            out["json_whitespace"] = "any"
    else:
        out = {key: tuple(value) if key == "choice" else value}
    return out


def _own(body: Sampling) -> dict[str, Any] | None:
    found = {k: getattr(body, k, None) for k in OWN_KEYS if getattr(body, k, None)}
    if not found:
        return None
    if "choice" in found:
        found["choice"] = tuple(found["choice"])
    return found


def constraint_fields(body: Sampling) -> tuple[dict[str, Any], dict[str, str]]:
    """(SamplingParams fields of the request's constraint, the renames that make an error name
    the request's own field); ({}, {}) when it has none. Two ways at once are a 400."""
    ways = [(name, f(body)) for name, f in (("response_format", _response_format),
                                            ("structured_outputs", _structured), ("constraint", _own))]  # fmt: skip
    given = [(name if name != "constraint" else next(iter(fields)), fields) for name, fields in ways if fields]
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise bad_request(f"{given[1][0]}: one constraint at a time, got {names}", given[1][0])
    if not given:
        whitespace = getattr(body, "json_whitespace", None)
        return ({}, {}) if whitespace in (None, "compact") else ({"json_whitespace": whitespace}, {})
    name, fields = given[0]
    if name in OWN_KEYS and getattr(body, "json_whitespace", None):
        fields["json_whitespace"] = body.json_whitespace
    renames = {
        "response_format": {"json_schema": "response_format.json_schema.schema"},
        "structured_outputs": {"json_schema": "structured_outputs.json", "regex": "structured_outputs.regex",
                               "choice": "structured_outputs.choice", "grammar": "structured_outputs.grammar"},
    }.get(name, {})  # fmt: skip
    return fields, renames


def check(params: SamplingParams, renames: dict[str, str]) -> None:
    """The constraint compiles (xgrammar, without a vocabulary); else a 400 naming the field."""
    try:
        grammar.check(params)
    except InvalidParameter as e:
        raise from_invalid(e, renames) from e

