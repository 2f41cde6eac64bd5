"""Sampling parameters, validated once, with messages that name the parameter and the value."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from lmtrace.errors import InvalidParameter

MAX_TOP_LOGPROBS = 100
MAX_BIAS = 100  # OpenAI's range of a logit_bias value: [-100, 100]
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # a token id as a JSON key writes it
# the constraints on the output (at most one is given); lmtrace.logits.grammar compiles them
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")
JSON_WHITESPACE = ("compact", "any")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Processors apply in this fixed order (as transformers does):
    logit bias -> repetition penalty -> temperature -> top-k -> top-p -> min-p."""

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
    # Constrained decoding (at most one of the four; the grammar's mask applies before the
    # processors): the output follows this JSON schema (an object; {"type": "object"} for any
    # JSON object), ...
    json_schema: dict[str, Any] | None = None
    # ... matches this regular expression, ...
    regex: str | None = None
    # ... is one of these strings (two or more, distinct), ...
    choice: tuple[str, ...] = field(default_factory=tuple)
    # ... or follows this EBNF grammar (xgrammar's dialect of GBNF; the rule `root` starts it).
    grammar: str | None = None
    # Whitespace a JSON schema allows: "compact" (none between tokens, so that a small model
    # cannot loop in whitespace) or "any" (the lenient grammar).
    json_whitespace: str = "compact"
    # Added to the logits before every other processor, greedy decoding included (OpenAI's
    # logit_bias): {token id: bias in [-100, 100]}; -100 in effect bans a token, 100 makes it the
    # only choice. Keys may be written as strings ("50256"), as JSON writes them.
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.choice, str):
            object.__setattr__(self, "choice", (self.choice,))
        elif isinstance(self.choice, list | tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json_schema, str):
            try:
                object.__setattr__(self, "json_schema", json.loads(self.json_schema))
            except ValueError as e:
                raise InvalidParameter(f"json_schema must be a JSON object, got text that is not JSON ({e})") from e
        object.__setattr__(self, "logit_bias", bias_of(self.logit_bias))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constraint(self) -> str | None:
        """The name of the constraint on the output (one of CONSTRAINTS), or None."""
        return next((name for name in CONSTRAINTS if getattr(self, name)), None)

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
        self._validate_constraint()

    def _validate_constraint(self) -> None:
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise InvalidParameter(f"json_schema must be a JSON object, got {self.json_schema!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameter(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.choice, tuple):
            raise InvalidParameter(f"choice must be a list of strings, got {self.choice!r}")
        bad = next((c for c in self.choice if not isinstance(c, str) or not c), None)
        if bad is not None:
            raise InvalidParameter(f"choice must be non-empty strings, got {bad!r}")
        if len(self.choice) == 1:
            raise InvalidParameter(f"choice needs two options or more (one is no choice), got only {self.choice[0]!r}")
        if len(set(self.choice)) != len(self.choice):
            twice = next(c for c in self.choice if self.choice.count(c) > 1)
            raise InvalidParameter(f"choice must list each option once, got {twice!r} twice")
        if self.json_whitespace not in JSON_WHITESPACE:
            raise InvalidParameter(f"json_whitespace must be compact or any, got {self.json_whitespace!r}")
        given = [name for name in CONSTRAINTS if getattr(self, name)]
        if len(given) > 1:
            raise InvalidParameter(f"{given[1]}: one constraint at a time, got {' and '.join(given)}")
        if given and not self.stop_on_eos:
            raise InvalidParameter(
                f"stop_on_eos: a constrained output ends with the end token, which cannot be ignored (with {given[0]})"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["choice"] = list(self.choice)
        # the constraint's fields are written only when one is given (older traces have none)
        for name in (*CONSTRAINTS, "json_whitespace"):
            if not d[name] or (name == "json_whitespace" and self.json_schema is None):
                del d[name]
        if self.logit_bias:  # its keys as JSON writes them, so that a record reads back the same
            d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        else:  # written only when given (older traces have none)
            del d["logit_bias"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def bias_of(value: Any) -> dict[int, float]:
    """A logit_bias as {token id: bias}: keys integers (or their decimal strings, as JSON keys),
    values finite numbers in [-MAX_BIAS, MAX_BIAS]; else InvalidParameter naming the key."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParameter(f"logit_bias must be an object of token id -> bias, got {value!r}")
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token = key
        else:
            raise InvalidParameter(f"logit_bias: key {key!r} is not a token id (a non-negative integer)")
        b = _number(f"logit_bias: the bias of token {token}", bias)
        if not -MAX_BIAS <= b <= MAX_BIAS:
            bound = f"[-{MAX_BIAS}, {MAX_BIAS}]"
            raise InvalidParameter(f"logit_bias: the bias of token {token} must be in {bound}, got {bias}")
        out[token] = b
    return out


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
