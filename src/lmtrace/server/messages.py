"""Chat messages as the model's chat template takes them. A message's content is a string or a
list of content parts; only text parts are read (the served models take text), and a part at
fault is named in OpenAI's words: `messages[0].content[0]: a text part needs "text"`,
`messages[1].content[0]: this model takes text only, got an "image_url" part`.

A template that knows tools (its source names `tools`) gets OpenAI's structures as
transformers documents them: assistant turns with `tool_calls` (`arguments` parsed into an
object) and `tool` turns. Another template (the bundled SmolLM2's is plain ChatML) gets them
as text, in the Hermes convention lmtrace.server.tools writes: an assistant turn's calls as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` and a tool turn's content inside
`<tool_response>` tags, in a `tool` role turn."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from lmtrace.server.errors import bad_request
from lmtrace.server.schemas import Message, unicode_text

# content parts of other modalities, refused in one line
NOT_TEXT = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video_url", "video")
TEXT_TYPES = ("text", "input_text", "output_text")  # the Responses API's names for a text part


def _where(i: int) -> tuple[str, str]:
    return f"messages[{i}]", f"messages.[{i}]"


def _part(part: Any, where: str, param: str) -> str:
    if not isinstance(part, dict):
        raise bad_request(f"{where}: a content part must be an object with a type, got {json.dumps(part)[:60]}", param)
    kind = part.get("type")
    if kind in NOT_TEXT:
        raise bad_request(f"{where}: this model takes text only, got an {json.dumps(kind)} part", param)
    if kind not in TEXT_TYPES:
        got = json.dumps(kind, ensure_ascii=False)[:60] if "type" in part else "none"
        raise bad_request(f'{where}.type: a content part is of type "text", got {got}', f"{param}.type")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f'{where}: a text part needs "text" (a string)', param)
    return _unicode(text, where, param)


def _unicode(text: str, where: str, param: str) -> str:
    try:
        return unicode_text(text)
    except ValueError as e:
        raise bad_request(f"{where} {e}", param) from None


def content_text(content: Any, i: int) -> str:
    """The text of message i's content (a string or text parts); "" for a null content (an
    assistant turn that only calls tools)."""
    where, param = _where(i)
    if content is None:
        return ""
    if isinstance(content, str):
        return _unicode(content, f"{where}.content", f"{param}.content")
    if isinstance(content, list):
        return "".join(_part(p, f"{where}.content[{k}]", f"{param}.content.[{k}]") for k, p in enumerate(content))
    got = json.dumps(content, ensure_ascii=False)[:60]
    raise bad_request(f"{where}.content must be a string or a list of content parts, got {got}", f"{param}.content")


def _arguments(text: str) -> Any:
    """A call's arguments as an object for the template; text that is not JSON stays text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_text(name: str, arguments: Any) -> str:
    """One call as the text convention writes it (what a model without a tools template reads)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def knows_reasoning(template: Any) -> bool:
    """Whether a chat template has a place for an assistant turn's reasoning (its source reads
    `reasoning_content` or `reasoning`, as Qwen3's and DeepSeek-R1's do)."""
    return isinstance(template, str) and "reasoning" in template


def turns(messages: Sequence[Message], native: bool, reasoning: bool = False) -> list[dict[str, Any]]:
    """The messages as template turns: OpenAI's tool structures for a template that knows tools
    (`native`), text for another; an assistant turn's reasoning as `reasoning_content` (and
    `reasoning`) for a template that has a place for it (`reasoning`), else dropped."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        calls = m.tool_calls or []
        text = content_text(m.content, i)
        parsed = [(c, _arguments(c.function.arguments)) for c in calls]
        if native:
            turn: dict[str, Any] = {"role": m.role, "content": text}
            if parsed:
                turn["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": a}}
                    for c, a in parsed
                ]
            if m.role == "tool":
                turn["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            turn = {"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>"}
        else:
            pieces = [text] if text else []
            turn = {"role": m.role, "content": "\n".join(pieces + [call_text(c.function.name, a) for c, a in parsed])}
        if m.name is not None and native:
            turn["name"] = m.name
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning and thought is not None:
            text_of = _unicode(thought, f"{_where(i)[0]}.reasoning_content", f"{_where(i)[1]}.reasoning_content")
            turn["reasoning_content"] = turn["reasoning"] = text_of
        out.append(turn)
    return out


# apply_chat_template's own arguments: not template variables a request may set
TAKEN = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                   "continue_final_message", "tokenize", "chat_template", "return_dict"})  # fmt: skip


def template_kwargs(extra: dict[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs` (extra variables for the model's chat template, such as
    `enable_thinking`), as vLLM takes them; one naming an argument of the templating itself is a 400."""
    extra = dict(extra or {})
    clash = sorted(TAKEN & set(extra))
    if clash:
        message = f"chat_template_kwargs: {clash[0]!r} is not a template variable to set here"
        raise bad_request(message, "chat_template_kwargs")
    return extra
