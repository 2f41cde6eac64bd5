"""Tools on chat and /v1/traces: OpenAI's `tools` and `tool_choice`, the functions handed to the
model through its chat template, and the call read back from what it wrote.

- A template that knows tools (its source names `tools`) renders them itself. For another (the
  bundled SmolLM2's plain ChatML) lmtrace writes them into the system prompt (`SYSTEM`: the
  functions' JSON inside `<tools></tools>`, a call asked for as `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`), before the system message's own text, or as the first
  message when there is none.
- `tool_choice` "auto" (the default with tools): the model writes freely; a `<tool_call>` it
  writes (an object, or a list of them) naming one of the tools becomes a call. "none": the
  tools are not shown and no call is read. "required" or a named function: the answer is one
  call, decoded under a JSON schema (the grammar family) that allows `{"name": one of the
  functions, "arguments": <that function's parameters schema>}`, so the arguments are valid
  JSON of that schema; with a text-convention template the prompt ends with `<tool_call>` so
  that the model writes the call where it would.
- Each call's arguments carry their confidence: structured output's `fields`
  (lmtrace.decode.fields) with paths `$.tool_calls[K].arguments...`."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from lmtrace.decode.fields import fields as json_fields
from lmtrace.records import Trace
from lmtrace.server.errors import bad_request
from lmtrace.server.schemas import Tools

SYSTEM = (
    "# Tools\n\nYou may call one of these functions to answer. Their signatures are inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a JSON object "
    'inside <tool_call></tool_call>:\n<tool_call>\n{{"name": <function name>, "arguments": <arguments '
    "as a JSON object>}}\n</tool_call>"
)
OPEN = "<tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What a request's tools ask for: the tools (OpenAI's dicts), whether the answer must be a
    call (`forced`, of one of `names`), whether the template renders tools itself."""

    tools: list[dict[str, Any]]
    names: list[str]
    forced: bool
    native: bool
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call of one of `names`. A function's parameters that refer
        within themselves (`$ref: "#/$defs/..."`, as pydantic's model_json_schema() writes nested
        models) are put whole under the call schema's `$defs`, their references rewritten to
        point there, so that they resolve inside the larger document."""
        defs: dict[str, Any] = {}
        options = []
        for n in self.names:
            arguments = self.schemas[n]
            if _refers(arguments):
                defs[n] = _rebased(arguments, "#/$defs/" + n)
                arguments = {"$ref": "#/$defs/" + n}
            options.append({"type": "object", "properties": {"name": {"const": n}, "arguments": arguments},
                            "required": ["name", "arguments"], "additionalProperties": False})  # fmt: skip
        out = options[0] if len(options) == 1 else {"anyOf": options}
        return {**out, "$defs": defs} if defs else out

    def system(self) -> str:
        return SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools))

    def prefix(self) -> str:
        """What the prompt ends with under a forced call: the text convention's opening tag."""
        return OPEN + "\n" if self.forced and not self.native else ""


def _refers(schema: Any) -> bool:
    """Whether a schema holds a reference within its own document (`"$ref": "#..."`)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_refers(v) for v in schema.values())
    return isinstance(schema, list) and any(_refers(v) for v in schema)


def _rebased(schema: Any, root: str) -> Any:
    """The schema with each reference within its document (`#`, `#/$defs/X`) made relative to
    `root`, the JSON pointer where the schema now sits; other references left as they are."""
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def knows_tools(template: Any) -> bool:
    return isinstance(template, str) and "tools" in template


def plan(body: Tools, template: Any) -> ToolPlan | None:
    """The request's ToolPlan; None without tools (or with tool_choice "none"). Checks that
    tool_choice fits the tools."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and not tools and choice != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if not tools or choice == "none":
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two functions have the same name", "tools")
    schemas = {t.function.name: t.function.parameters or NO_ARGUMENTS for t in tools}
    wanted = names
    if not isinstance(choice, str) and choice is not None:
        if choice.function.name not in names:
            message = f"tool_choice names {choice.function.name!r}, which is not one of the tools"
            raise bad_request(message, "tool_choice")
        wanted = [choice.function.name]
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    forced = choice == "required" or not isinstance(choice, (str, type(None)))
    return ToolPlan(dicts, wanted, forced, knows_tools(template), schemas)


@dataclass
class Call:
    """A call read from the answer: its function, its arguments' JSON text, and where that JSON
    (the whole {"name", "arguments"} object) is in the answer's text."""

    name: str
    arguments: str
    span: tuple[int, int]
    prefix: str = "$.arguments"  # the arguments' JSONPath in that JSON ($[j].arguments in a list)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    complete: bool = True  # False: a forced call cut by the length limit (its arguments as written so far)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _read(text: str, at: int, names: list[str]) -> list[Call]:
    """The call(s) of the JSON starting at `at` (an object, or a list of them), [] if it is none."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    try:
        value, end = json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return []
    items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
    calls = []
    for j, item in items:
        if isinstance(item, dict) and item.get("name") in names and isinstance(item.get("arguments", {}), dict):
            arguments = json.dumps(item.get("arguments", {}), ensure_ascii=False)
            prefix = "$.arguments" if j is None else f"$[{j}].arguments"
            calls.append(Call(item["name"], arguments, (at, end), prefix))
    return calls


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*)("?)')  # a forced call's opening, its name
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


def _partial(text: str, names: list[str]) -> list[Call]:
    """A forced call the length limit cut (`{"name": "f", "arguments": {"city": "Par`): its
    function, where the text names it or only one fits what it wrote, and its arguments as
    written so far; [] where the function cannot be told."""
    m = _NAME.match(text)
    written = json.loads(m.group(1) + '"') if m and m.group(2) else None
    if written is None:  # the name itself cut: the one function it can still be
        begun = m.group(1)[1:] if m else ""
        fits = [n for n in names if n.startswith(begun)]
        if len(fits) != 1:
            return []
        return [Call(fits[0], "", (0, len(text)), complete=False)]
    if written not in names:
        return []
    rest = _ARGUMENTS.match(text, m.end())
    arguments = text[rest.end() :] if rest else ""
    return [Call(written, arguments, (0, len(text)), complete=False)]


def read_calls(plan: ToolPlan, text: str) -> tuple[list[Call], str]:
    """(calls, the text before them) of an answer: under a forced call the whole answer is the
    call's JSON (a call the length limit cut is still one, `complete` False); otherwise each
    `<tool_call>` block naming a tool, or an answer that is itself a call's JSON."""
    if plan.forced:
        return _read(text, 0, plan.names) or _partial(text, plan.names), ""
    calls = []
    for m in re.finditer(re.escape(OPEN), text):
        calls += _read(text, m.end(), plan.names)
    if not calls and text.lstrip().startswith(("{", "[")):
        calls = _read(text, 0, plan.names)
    if not calls:
        return [], text
    before = text[: text.find(OPEN)] if OPEN in text else ""
    return calls, before.strip()


def call_fields(trace: Trace, calls: list[Call], forced: bool) -> list[dict[str, Any]]:
    """Each call's argument values with the model's confidence (structured output's fields),
    their paths `$.tool_calls[K].arguments...`; the function's name is not an argument."""
    out = []
    for k, call in enumerate(calls):
        a, b = call.span
        if forced and trace.fields is not None:
            found = trace.fields  # the constrained answer's own
        else:  # the call's JSON inside free text: its values, at their places in the answer
            found = json_fields(" " * a + trace.text[a:b], trace.steps)
        for f in found:
            path = f["path"]
            if path == call.prefix or path.startswith((call.prefix + ".", call.prefix + "[")):
                out.append({**f, "path": f"$.tool_calls[{k}].arguments" + path[len(call.prefix) :]})
    return out
