"""The user's processors by name, for the entry points whose requests cannot carry a Python
callable (a JSON line of `lmtrace batch`, a request to `lmtrace serve`): as vLLM v1's
`--logits-processors`, the operator registers each at start-up under a name
(`--logits-processor NAME=module:function`: importing the module is the operator's choice), and
a request names the ones it wants (`"logits_processors": ["NAME", ...]`). The library takes the
same registry as {name: function}.

    registry = named.registry(["no_top=mypkg.procs:no_top_token"])   # {name: function}
    user = named.resolve(["no_top"], registry)                        # UserProcessors, in order
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.logits.processors import UserFn, UserProcessor

# how the operator names one: on the command line and in the refusals
SPEC = "NAME=module:function"


def load(target: str) -> UserFn:
    """The function `module:function` names (the module imported)."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise InvalidParameter(f"logits_processor: expected {SPEC}, got {target!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise InvalidParameter(f"logits_processor: cannot import {target!r} ({e})") from e
    if not callable(fn):
        raise InvalidParameter(f"logits_processor: {target!r} is not callable, got {type(fn).__name__}")
    return fn


def registry(specs: Iterable[str] | Mapping[str, Any] | None) -> dict[str, UserFn]:
    """{name: function} from `NAME=module:function` specs, or from a mapping whose values are
    functions or `module:function` strings; each name once."""
    if specs is None:
        return {}
    pairs = list(specs.items()) if isinstance(specs, Mapping) else [_split(s) for s in specs]
    out: dict[str, UserFn] = {}
    for name, target in pairs:
        if not isinstance(name, str) or not name or name in out:
            raise InvalidParameter(f"logits_processor: each name must be given once and not be empty, got {name!r}")
        fn = load(target) if isinstance(target, str) else target
        if not callable(fn):
            raise InvalidParameter(f"logits_processor: {name} must be a callable, got {type(fn).__name__}")
        out[name] = fn
    return out


def _split(spec: str) -> tuple[str, str]:
    name, sep, target = spec.partition("=")
    if not sep or not name.strip():
        raise InvalidParameter(f"logits_processor: expected {SPEC}, got {spec!r}")
    return name.strip(), target.strip()


def resolve(names: Any, known: Mapping[str, UserFn]) -> tuple[UserProcessor, ...]:
    """The processors a request names, in its order, each recorded under its registered name;
    a name not registered is refused in one line naming `logits_processors` and the value."""
    if names is None:
        return ()
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise InvalidParameter(f"logits_processors must be a list of registered names, got {names!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        registered = ", ".join(sorted(known)) or "none"
        raise InvalidParameter(
            f"logits_processors: no processor is registered as {unknown[0]!r} (registered: {registered}; "
            f"the operator adds one with --logits-processor {SPEC})"
        )
    return tuple(UserProcessor(known[n], n) for n in names)
