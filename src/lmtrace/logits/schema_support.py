"""JSON-schema keywords the grammar engine (xgrammar 0.2) does not enforce. xgrammar compiles a
schema that holds them without an error and then ignores them (an output could break them), so
lmtrace refuses them as bad input instead. The list follows vLLM's
`has_xgrammar_unsupported_json_features` and what xgrammar 0.2.8 was seen to ignore (`not`,
`if`/`then`/`else`, `dependentRequired`, `dependentSchemas`, a `$ref` outside the schema).

The walk follows the places where a schema holds schemas, so a property *named* `not` is no
keyword."""

from __future__ import annotations

from typing import Any

# keywords ignored wherever they appear
IGNORED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "$dynamicRef",
    "multipleOf",
)
# the string formats xgrammar enforces
FORMATS = {
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "ipv4",
    "ipv6",
    "hostname",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
}
# keywords holding one schema, a list of schemas, or a name -> schema mapping
ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions")


def _own(schema: dict[str, Any]) -> str | None:
    """The first keyword of this schema object (not of its subschemas) that is not enforced."""
    for keyword in IGNORED:
        if keyword in schema:
            return keyword
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"$ref {ref!r} (only references inside the schema, '#/...')"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS:
        return f"format {fmt!r}"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return "minLength/maxLength together with pattern or format"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf with more than one schema"
    if "propertyNames" in schema and any(k in schema for k in ("properties", "patternProperties")):
        return "propertyNames together with properties or patternProperties"
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict) and ("properties" in schema or len(patterns) > 1):
        return "patternProperties together with properties, or more than one pattern"
    return None


def _children(schema: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for keyword in ONE:
        value = schema.get(keyword)
        if isinstance(value, list):
            out += [(f"{keyword}/{i}", s) for i, s in enumerate(value)]
        elif isinstance(value, dict):
            out.append((keyword, value))
    for keyword in MANY:
        if isinstance(schema.get(keyword), list):
            out += [(f"{keyword}/{i}", s) for i, s in enumerate(schema[keyword])]
    for keyword in NAMED:
        if isinstance(schema.get(keyword), dict):
            out += [(f"{keyword}/{name}", s) for name, s in schema[keyword].items()]
    return out


def unsupported(schema: Any, where: str = "#") -> str | None:
    """The first keyword xgrammar would ignore and where it is ('uniqueItems at
    #/properties/tags'), or None when the whole schema is enforced."""
    if not isinstance(schema, dict):
        return None
    own = _own(schema)
    if own is not None:
        return f"{own} at {where}"
    for path, child in _children(schema):
        found = unsupported(child, f"{where}/{path}")
        if found is not None:
            return found
    return None
