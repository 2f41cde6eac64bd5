"""The `lmtrace` format, one rollout a line:

    {"id": "q1/0", "prompt_ids": [...] or "prompt": "text", "completion_ids": [...],
     "logprobs": [the engine's logprob of each completion id],
     "sampling": {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0}}

A missing sampling key means temperature 1 and no filter; a missing id is the line number."""

from __future__ import annotations

from typing import Any

from lmtrace.scoring.rollouts.rollout import Rollout, bad, ids_of, logprobs_of, sampling_of


def read(obj: dict[str, Any], line: int) -> list[Rollout]:
    """The rollout of one line."""
    prompt_ids, prompt_text = obj.get("prompt_ids"), obj.get("prompt")
    if prompt_ids is None and prompt_text is None:
        raise bad(line, "prompt_ids", "is missing (give prompt_ids, or the prompt as text in prompt)")
    if prompt_ids is not None:
        prompt_ids, prompt_text = ids_of(line, "prompt_ids", prompt_ids), None
    elif not isinstance(prompt_text, str) or not prompt_text:
        raise bad(line, "prompt", f"must be a non-empty text, got {prompt_text!r}")
    completion = ids_of(line, "completion_ids", obj.get("completion_ids"))
    return [
        Rollout(
            id=str(obj.get("id", line)),
            prompt_ids=prompt_ids or [],
            completion_ids=completion,
            logprobs=logprobs_of(line, "logprobs", obj.get("logprobs"), len(completion)),
            sampling=sampling_of(line, obj.get("sampling")),
            line=line,
            prompt_text=prompt_text,
        )
    ]
