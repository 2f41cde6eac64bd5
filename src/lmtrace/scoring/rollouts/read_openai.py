"""An OpenAI-style completion or chat completion response with logprobs and token ids, one a
line, each choice a rollout:

    {"id": "cmpl-1", "prompt_token_ids": [...],
     "choices": [{"index": 0, "token_ids": [...],
                  "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.3, ...}, ...]}}],
     "sampling": {"temperature": 0.7}}

The ids come from `choices[].token_ids` (vLLM's `return_token_ids`), else from each content
entry: its `token_id`, or a `token` written "token_id:N" (vLLM's
`--return-tokens-as-token-ids`). The prompt ids: `prompt_token_ids` (top level or in the
choice). The settings: "sampling", else the request's own keys if the line carries them."""

from __future__ import annotations

from typing import Any

from lmtrace.scoring.rollouts.masked import settings
from lmtrace.scoring.rollouts.rollout import Rollout, bad, ids_of, logprobs_of


def _token_id(line: int, name: str, entry: Any) -> int:
    if not isinstance(entry, dict):
        raise bad(line, name, "must be an object with token and logprob")
    if isinstance(entry.get("token_id"), int):
        return entry["token_id"]
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    raise bad(line, f"{name}.token", f"carries no token id (want token_id, or 'token_id:N'), got {token!r}")


Choice = tuple[list[int], list[int], list[Any], tuple[str, str]]


def _choice(obj: dict[str, Any], choice: Any, k: int, line: int) -> Choice:
    """(prompt ids, completion ids, logprobs, where the two lists of ids are in the line)."""
    name = f"choices[{k}]"
    if not isinstance(choice, dict):
        raise bad(line, name, "must be an object")
    where = f"{name}.prompt_token_ids" if "prompt_token_ids" in choice else "prompt_token_ids"
    prompt = ids_of(line, where, choice.get("prompt_token_ids", obj.get("prompt_token_ids")))
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or not content:
        raise bad(line, f"{name}.logprobs.content", "is missing (ask with logprobs: true)")
    if choice.get("token_ids") is not None:
        field = f"{name}.token_ids"
        ids = ids_of(line, field, choice["token_ids"])
    else:
        field = f"{name}.logprobs.content"  # an id's error names its entry: content[i]
        ids = ids_of(line, field, [_token_id(line, f"{field}[{i}]", e) for i, e in enumerate(content)])
    return prompt, ids, [e.get("logprob") if isinstance(e, dict) else e for e in content], (where, field)


def read(obj: dict[str, Any], line: int) -> list[Rollout]:
    """The rollouts of one response: one per choice."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise bad(line, "choices", "must be a non-empty list")
    sampling = settings(obj, line)
    out = []
    for k, choice in enumerate(choices):
        prompt, ids, values, fields = _choice(obj, choice, k, line)
        index = choice.get("index", k)
        lp = logprobs_of(line, f"choices[{k}].logprobs.content", values, len(ids))
        out.append(Rollout(f"{obj.get('id', line)}/{index}", prompt, ids, lp, sampling, line, fields=fields))
    return out
