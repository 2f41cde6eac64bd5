"""vLLM's `RequestOutput` (from `LLM.generate` with `SamplingParams(logprobs=k)`), written as
JSON one request a line, each of its `outputs` a rollout (GRPO's n samples share the prompt):

    {"request_id": "0", "prompt_token_ids": [...],
     "outputs": [{"index": 0, "token_ids": [...],
                  "logprobs": [{"5": {"logprob": -0.3, "rank": 1, "decoded_token": "a"}, ...}, ...]}],
     "sampling_params": {"temperature": 0.8, "top_p": 0.95, "top_k": -1, "min_p": 0.0}}

`outputs[].logprobs[i]` maps token ids (JSON keys: strings) to `Logprob`s (an object with
`logprob`, or the bare number); the sampled id's entry is the engine's logprob (vLLM always
includes it beside the top k). RequestOutput does not hold the sampling settings: they are
read from "sampling_params" (the SamplingParams given, as a dict) or "sampling"."""

from __future__ import annotations

from typing import Any

from lmtrace.scoring.rollouts.rollout import Rollout, bad, ids_of, logprobs_of, sampling_of


def _sampled(line: int, name: str, ids: list[int], steps: Any) -> list[Any]:
    if not isinstance(steps, list):
        raise bad(line, name, f"must be a list of {{token id: Logprob}}, got {type(steps).__name__}")
    out = []
    for i, (token, step) in enumerate(zip(ids, steps)):
        entry = step.get(str(token), step.get(token)) if isinstance(step, dict) else None
        if entry is None:
            raise bad(line, f"{name}[{i}]", f"has no entry for the sampled id {token}")
        out.append(entry.get("logprob") if isinstance(entry, dict) else entry)
    return out + [None] * (len(steps) - len(ids)) if len(steps) > len(ids) else out


def read(obj: dict[str, Any], line: int) -> list[Rollout]:
    """The rollouts of one request: one per output."""
    prompt = ids_of(line, "prompt_token_ids", obj.get("prompt_token_ids"))
    outputs = obj.get("outputs")
    if not isinstance(outputs, list) or not outputs:
        raise bad(line, "outputs", "must be a non-empty list of CompletionOutputs")
    raw = obj.get("sampling_params", obj.get("sampling"))
    sampling = sampling_of(line, raw)
    out = []
    for k, o in enumerate(outputs):
        if not isinstance(o, dict):
            raise bad(line, f"outputs[{k}]", "must be an object")
        ids = ids_of(line, f"outputs[{k}].token_ids", o.get("token_ids"))
        if o.get("logprobs") is None:
            raise bad(line, f"outputs[{k}].logprobs", "is missing (generate with SamplingParams(logprobs=0) or more)")
        steps = o["logprobs"]
        values = _sampled(line, f"outputs[{k}].logprobs", ids, steps) if len(steps) >= len(ids) else steps
        name = f"{obj.get('request_id', line)}/{o.get('index', k)}"
        out.append(
            Rollout(
                name,
                prompt,
                ids,
                logprobs_of(line, f"outputs[{k}].logprobs", values, len(ids)),
                sampling,
                line,
                fields=("prompt_token_ids", f"outputs[{k}].token_ids"),
            )
        )
    return out
