"""What the operator registers by name at start-up, for the entry points whose requests cannot
carry a Python object (a JSON line of `lmtrace batch`, a request to `lmtrace serve`): as vLLM
v1's `--logits-processors`, each is given as `NAME=module:attribute` (importing the module is the
operator's choice) or, from Python, as {name: object}; a request names the ones it wants. The
processors (lmtrace.logits.named) and the observers (lmtrace.decode.named_observers) are two
kinds of it.

    kind = Kind("observer", "observers", "NAME=module:Class", "--observer")
    known = registry(["margin=mypkg.watch:Margin"], kind)   # {name: the object}
    check(["margin"], known, kind)                           # a name not registered: refused
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lmtrace.errors import InvalidParameter


@dataclass(frozen=True)
class Kind:
    """One kind of registered object: its name in refusals (`option`), the request's field that
    names them (`field`), how the operator writes one (`spec`) and the command-line flag."""

    option: str
    field: str
    spec: str
    flag: str


@dataclass(frozen=True)
class Registered:
    """What the operator registered: the processors {name: function} and the observers
    {name: class} a request may name."""

    processors: Mapping[str, Any] = field(default_factory=dict)
    observers: Mapping[str, Any] = field(default_factory=dict)


def load(target: str, kind: Kind) -> Any:
    """The object `module:attribute` names (the module imported), callable."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise InvalidParameter(f"{kind.option}: expected {kind.spec}, got {target!r}")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise InvalidParameter(f"{kind.option}: cannot import {target!r} ({e})") from e
    if not callable(found):
        raise InvalidParameter(f"{kind.option}: {target!r} is not callable, got {type(found).__name__}")
    return found


def registry(specs: Iterable[str] | Mapping[str, Any] | None, kind: Kind) -> dict[str, Any]:
    """{name: object} from `NAME=module:attribute` specs, or from a mapping whose values are the
    objects or `module:attribute` strings; each name once, each object callable."""
    if specs is None:
        return {}
    pairs = list(specs.items()) if isinstance(specs, Mapping) else [_split(s, kind) for s in specs]
    out: dict[str, Any] = {}
    for name, target in pairs:
        if not isinstance(name, str) or not name or name in out:
            raise InvalidParameter(f"{kind.option}: each name must be given once and not be empty, got {name!r}")
        found = load(target, kind) if isinstance(target, str) else target
        if not callable(found):
            raise InvalidParameter(f"{kind.option}: {name} must be a callable, got {type(found).__name__}")
        out[name] = found
    return out


def _split(spec: str, kind: Kind) -> tuple[str, str]:
    name, sep, target = spec.partition("=")
    if not sep or not name.strip():
        raise InvalidParameter(f"{kind.option}: expected {kind.spec}, got {spec!r}")
    return name.strip(), target.strip()


def check(names: Any, known: Mapping[str, Any], kind: Kind) -> list[str]:
    """The names a request gives, in its order (None: none); not a list of strings, or a name
    not registered, is refused in one line naming the request's field and the value."""
    if names is None:
        return []
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise InvalidParameter(f"{kind.field} must be a list of registered names, got {names!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        registered = ", ".join(sorted(known)) or "none"
        raise InvalidParameter(
            f"{kind.field}: no {kind.option.replace('_', ' ')} is registered as {unknown[0]!r} "
            f"(registered: {registered}; the operator adds one with {kind.flag} {kind.spec})"
        )
    return list(names)
