"""One rollout as the engine wrote it: prompt and completion ids, the engine's logprob of each
completion id, the sampling settings it was drawn under. Every reader (one module per format)
gives these; `check` holds them to the rules, naming the line and the field. No torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.params import SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


@dataclass
class Rollout:
    """A rollout: `logprobs[i]` is the engine's logprob of `completion_ids[i]`; `sampling` holds
    the settings of SAMPLING_KEYS it was drawn under (a missing one: temperature 1, no filter)."""

    id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    sampling: dict[str, Any] = field(default_factory=dict)
    line: int = 0  # the line of the file it came from (1-based; 0: given in memory)
    prompt_text: str | None = None  # a prompt given as text: encoded by `encode` once the model is known
    # where the prompt and completion ids are in the line, for errors (a padded batch's row: its
    # ids counted once the mask has dropped the padding)
    fields: tuple[str, str] = ("prompt_ids", "completion_ids")

    def params(self) -> SamplingParams:
        """The settings as SamplingParams (the processors' own validation)."""
        return SamplingParams(**{k: v for k, v in self.sampling.items() if k in SAMPLING_KEYS})


def bad(line: int, name: str, why: str) -> InvalidParameter:
    """The one-line error of a rollout file: the line, the field, what is wrong."""
    where = f"line {line}" if line else "record"
    return InvalidParameter(f"rollouts: {where}: {name} {why}")


def ids_of(line: int, name: str, value: Any, allow_empty: bool = False) -> list[int]:
    """A list of token ids (whole numbers >= 0)."""
    if value is None:
        raise bad(line, name, "is missing")
    if not isinstance(value, list) or (not value and not allow_empty):
        raise bad(line, name, f"must be a non-empty list of token ids, got {_short(value)}")
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise bad(line, f"{name}[{i}]", f"must be a token id (a whole number >= 0), got {_short(x)}")
    return list(value)


def logprobs_of(line: int, name: str, value: Any, length: int) -> list[float]:
    """A list of `length` logprobs (numbers <= 0; None or -inf is not a logprob of a sampled token)."""
    if value is None:
        raise bad(line, name, "is missing")
    if not isinstance(value, list):
        raise bad(line, name, f"must be a list of numbers, got {_short(value)}")
    if len(value) != length:
        raise bad(line, name, f"has {len(value)} values for {length} completion ids (one logprob per id)")
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x > 1e-4:
            raise bad(line, f"{name}[{i}]", f"must be a finite logprob <= 0, got {_short(x)}")
        out.append(float(x))
    return out


def sampling_of(line: int, value: Any) -> dict[str, Any]:
    """The sampling settings: an object of SAMPLING_KEYS, each checked as SamplingParams checks it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(line, "sampling", f"must be an object, got {_short(value)}")
    known = {k: v for k, v in value.items() if k in SAMPLING_KEYS and v is not None}
    if known.get("top_k") == -1:  # vLLM's and verl's "no top-k"
        known["top_k"] = 0
    try:
        SamplingParams(**known)
    except (InvalidParameter, TypeError) as e:
        raise bad(line, "sampling", f"is not valid ({e})") from e
    return known


def encode(rollout: Rollout, tokenizer: Any) -> None:
    """A prompt given as text becomes its ids, encoded as `generate` encodes a prompt."""
    if rollout.prompt_text is not None and not rollout.prompt_ids:
        rollout.prompt_ids = list(tokenizer(rollout.prompt_text)["input_ids"])
        if not rollout.prompt_ids:
            raise bad(rollout.line, "prompt", "encodes to no tokens (the model needs one before the completion)")


def check(rollout: Rollout, vocab: int) -> None:
    """Every id inside the vocabulary of `vocab` tokens (the error names the field in the line)."""
    for name, ids in zip(rollout.fields, (rollout.prompt_ids, rollout.completion_ids)):
        for i, x in enumerate(ids):
            if x >= vocab:
                raise bad(rollout.line, f"{name}[{i}]", f"= {x} is outside the model's vocabulary of {vocab} tokens")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
