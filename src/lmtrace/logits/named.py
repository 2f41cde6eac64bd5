"""The user's processors by name, for the entry points whose requests cannot carry a Python
callable (a JSON line of `lmtrace batch`, a request to `lmtrace serve`): as vLLM v1's
`--logits-processors`, the operator registers each at start-up under a name
(`--logits-processor NAME=module:function`: importing the module is the operator's choice), and
a request names the ones it wants (`"logits_processors": ["NAME", ...]`). The library takes the
same registry as {name: function}. (lmtrace.registered: what every registered kind shares.)

    registry = named.registry(["no_top=mypkg.procs:no_top_token"])   # {name: function}
    user = named.resolve(["no_top"], registry)                        # UserProcessors, in order
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lmtrace import registered
from lmtrace.logits.processors import UserFn, UserProcessor

KIND = registered.Kind("logits_processor", "logits_processors", "NAME=module:function", "--logits-processor")
# how the operator names one: on the command line and in the refusals
SPEC = KIND.spec


def load(target: str) -> UserFn:
    """The function `module:function` names (the module imported)."""
    return registered.load(target, KIND)


def registry(specs: Iterable[str] | Mapping[str, Any] | None) -> dict[str, UserFn]:
    """{name: function} from `NAME=module:function` specs, or from a mapping whose values are
    functions or `module:function` strings; each name once."""
    return registered.registry(specs, KIND)


def resolve(names: Any, known: Mapping[str, UserFn]) -> tuple[UserProcessor, ...]:
    """The processors a request names, in its order, each recorded under its registered name;
    a name not registered is refused in one line naming `logits_processors` and the value."""
    return tuple(UserProcessor(known[n], n) for n in registered.check(names, known, KIND))
