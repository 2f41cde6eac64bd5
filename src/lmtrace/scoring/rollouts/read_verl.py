"""verl's rollout batch (a `DataProto` after generation with `rollout.calculate_log_probs=True`),
its tensors written with `.tolist()`, one batch (or one row) a line:

    {"prompts": [[pad, 12, 7], ...], "responses": [[5, 9, pad], ...],
     "attention_mask": [[0, 1, 1, 1, 1, 0], ...], "response_mask": [[1, 1, 0], ...],
     "rollout_log_probs": [[-0.3, -1.2, 0.0], ...], "uid": ["q1", ...],
     "meta_info": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}}

`prompts` are left-padded and `responses` right-padded to the batch's widths; the prompt's
part of `attention_mask` (its first width(prompts) columns) drops the prompt's padding and
`response_mask` (else the rest of `attention_mask`) the response's; `rollout_log_probs` are the
engine's logprobs of the response ids; the sampling settings are the rollout config's, in
`meta_info` (verl's top_k -1: no top-k), top-level keys or "sampling"."""

from __future__ import annotations

from typing import Any

from lmtrace.scoring.rollouts.masked import batch_rows, settings
from lmtrace.scoring.rollouts.rollout import Rollout


def read(obj: dict[str, Any], line: int) -> list[Rollout]:
    """The rollouts of one verl batch (or row)."""
    obj = dict(obj)
    mask, prompts = obj.get("attention_mask"), obj.get("prompts")
    if isinstance(mask, list) and isinstance(prompts, list) and prompts:
        width = len(prompts[0]) if isinstance(prompts[0], list) else len(prompts)
        two_d = bool(mask) and isinstance(mask[0], list)
        obj["prompt_mask"] = [m[:width] for m in mask] if two_d else mask[:width]
        if "response_mask" not in obj:
            obj["response_mask"] = [m[width:] for m in mask] if two_d else mask[width:]
    rows = batch_rows(
        obj,
        line,
        prompt=("prompts", "prompt_mask"),
        completion=("responses", "response_mask"),
        logprobs="rollout_log_probs",
    )
    uids = obj.get("uid")
    names = [str(u) for u in uids] if isinstance(uids, list) and len(uids) == len(rows) else None
    sampling = settings(obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else obj, line)
    return [
        Rollout(
            f"{names[i] if names else line}/{i}", p, c, lp, sampling, line, fields=(f"prompts[{i}]", f"responses[{i}]")
        )
        for i, (p, c, lp) in enumerate(rows)
    ]
