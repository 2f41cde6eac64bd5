"""Policy specs: `name` or `name:key=value,key=value`, parsed and checked before any model
loads; every error is one line naming the policy and the parameter."""

from __future__ import annotations

from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.kvlab.policies.base import Param, Policy, invalid
from lmtrace.kvlab.policies.fp8 import Fp8
from lmtrace.kvlab.policies.full import Full
from lmtrace.kvlab.policies.h2o import H2O
from lmtrace.kvlab.policies.intq import Int2, IntQ
from lmtrace.kvlab.policies.knorm import Knorm
from lmtrace.kvlab.policies.snapkv import SnapKV
from lmtrace.kvlab.policies.streaming import Streaming
from lmtrace.kvlab.policies.tova import Tova
from lmtrace.kvlab.policies.window import Window

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, Window, Streaming, H2O, SnapKV, Tova, Knorm, Fp8, IntQ, Int2)
}


def _value(policy: str, key: str, raw: str, param: Param) -> Any:
    if param.kind == "choice":
        if raw not in param.choices:
            raise invalid(policy, f"{key} must be one of {', '.join(param.choices)}, got {raw!r}")
        return raw
    try:
        number = float(raw)
    except ValueError:
        raise invalid(policy, f"{key} must be a number, got {raw!r}") from None
    if param.kind == "fraction":
        return number
    if param.kind == "budget":
        if 0 < number < 1:
            return number
        if number >= 1 and number.is_integer():
            return int(number)
        raise invalid(policy, f"{key} must be a fraction in (0, 1) or a whole number of positions >= 1, got {raw!r}")
    if not number.is_integer() or number < param.low:
        raise invalid(policy, f"{key} must be a whole number >= {param.low}, got {raw!r}")
    return int(number)


def parse_policy(spec: str | Policy) -> Policy:
    """`streaming:sinks=4,window=32` -> a Streaming policy; a Policy passes through."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidParameter(f"policy: a spec such as 'window:size=32' is needed, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    cls = POLICIES.get(name.strip().lower())
    if cls is None:
        raise InvalidParameter(f"policy: unknown policy {name!r} (known: {', '.join(POLICIES)})")
    values = {key: p.default for key, p in cls.params.items()}
    given: set[str] = set()
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip().lower()
        if not eq or not raw.strip():
            raise invalid(cls.name, f"{key or item!r} needs a value, as in {key or 'size'}=32")
        if key not in cls.params:
            known = ", ".join(cls.params) or "none"
            raise invalid(cls.name, f"unknown parameter {key!r} (parameters: {known})")
        if key in given:
            raise invalid(cls.name, f"{key} is given twice")
        given.add(key)
        values[key] = _value(cls.name, key, raw.strip(), cls.params[key])
    policy = cls(values)
    policy.validate()
    return policy


def parse_policies(specs: list[str | Policy]) -> list[Policy]:
    if not specs:
        raise InvalidParameter("policy: give at least one --policy (e.g. --policy window:size=32)")
    policies = [parse_policy(s) for s in specs]
    seen: dict[str, int] = {}
    for p in policies:
        if p.spec in seen:
            raise InvalidParameter(f"policy {p.name}: {p.spec!r} is given twice")
        seen[p.spec] = 1
    return policies


def known() -> list[tuple[str, str]]:
    """(spec with defaults, what it keeps) for every policy, for --help and the README."""
    return [(cls({k: p.default for k, p in cls.params.items()}).spec, cls.about) for cls in POLICIES.values()]
