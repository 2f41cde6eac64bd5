"""Sampling parameters, validated once, with messages that name the parameter and the value."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lmtrace.errors import InvalidParameter

MAX_TOP_LOGPROBS = 100


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Processors apply in this fixed order (as transformers does):
    repetition penalty -> temperature -> top-k -> top-p -> min-p."""

    # Number of tokens to generate at most (> 0).
    max_new_tokens: int = 64
    # 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    temperature: float = 1.0
    # Keep only the k most likely tokens; 0 disables.
    top_k: int = 0
    # Keep the smallest set of tokens whose probability adds up to top_p; 1.0 disables.
    top_p: float = 1.0
    # Drop tokens whose probability is below min_p times the top token's; 0.0 disables.
    min_p: float = 0.0
    # Divide positive logits (multiply negative ones) of tokens already seen; 1.0 disables.
    repetition_penalty: float = 1.0
    # Seed of the explicit torch.Generator; None picks one at random (and the trace records it).
    seed: int | None = None
    # Strings that end the generation; the text is cut before the first one found.
    stop: tuple[str, ...] = field(default_factory=tuple)
    # How many of the most likely alternatives each step records (0..100).
    top_logprobs: int = 5
    # Stop when the model emits one of its end-of-sequence tokens.
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        check_integer("max_new_tokens", self.max_new_tokens, low=1)
        check_integer("top_k", self.top_k, low=0)
        check_integer("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.seed is not None:
            check_integer("seed", self.seed, low=0)
            if self.seed >= 2**64:  # torch.Generator takes 64 bits
                raise InvalidParameter(f"seed must be < 2**64, got {self.seed}")
        t = _number("temperature", self.temperature)
        if t < 0:
            raise InvalidParameter(f"temperature must be >= 0, got {t}")
        p = _number("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise InvalidParameter(f"top_p must be in (0, 1], got {p}")
        m = _number("min_p", self.min_p)
        if not 0.0 <= m <= 1.0:
            raise InvalidParameter(f"min_p must be in [0, 1], got {m}")
        r = _number("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise InvalidParameter(f"repetition_penalty must be > 0, got {r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidParameter(f"stop must be non-empty strings, got {s!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def check_integer(name: str, value: Any, *, low: int, high: int | None = None) -> int:
    """`value` as an integer parameter in [low, high]; else InvalidParameter naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidParameter(f"{name} must be {bound}, got {value}")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParameter(f"{name} must be a finite number, got {value}")
    return float(value)
