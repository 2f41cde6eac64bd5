"""TRL's GRPO batch, as `GRPOTrainer._generate_and_score_completions` returns it with vLLM
generation and importance sampling on (`vllm_importance_sampling_correction`), its tensors
written with `.tolist()`, one batch (or one row) a line:

    {"prompt_ids": [[pad, pad, 12, 7], ...], "prompt_mask": [[0, 0, 1, 1], ...],
     "completion_ids": [[5, 9, eos, pad], ...], "completion_mask": [[1, 1, 1, 0], ...],
     "sampling_per_token_logps": [[-0.3, -1.2, -0.1, 0.0], ...],
     "temperature": 0.9, "top_p": 1.0, "top_k": 0, "min_p": 0.0}

prompt_mask and completion_mask drop the padding (prompts padded on the left, completions on
the right; without a mask nothing is dropped); `sampling_per_token_logps` are vLLM's logprobs
of the sampled ids; the sampling settings are GRPOConfig's (top-level keys or "sampling")."""

from __future__ import annotations

from typing import Any

from lmtrace.scoring.rollouts.masked import batch_rows, settings
from lmtrace.scoring.rollouts.rollout import Rollout


def read(obj: dict[str, Any], line: int) -> list[Rollout]:
    """The rollouts of one TRL batch (or row)."""
    rows = batch_rows(
        obj,
        line,
        prompt=("prompt_ids", "prompt_mask"),
        completion=("completion_ids", "completion_mask"),
        logprobs="sampling_per_token_logps",
    )
    sampling = settings(obj, line)
    return [
        Rollout(
            f"{obj.get('id', line)}/{i}", p, c, lp, sampling, line, fields=(f"prompt_ids[{i}]", f"completion_ids[{i}]")
        )
        for i, (p, c, lp) in enumerate(rows)
    ]
