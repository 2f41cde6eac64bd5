"""The user's observers by name, for the entry points whose requests cannot carry a Python
object (a JSON line of `lmtrace batch`, a request to `lmtrace serve`): the operator registers
each at start-up (`--observer NAME=module:Class`, or from Python {name: class}), and a request
names the ones it wants (`"observers": ["NAME", ...]`). What is registered is a class (or any
callable) that makes a fresh `lmtrace.Observer` with no arguments: each row of a request gets
its own instance, as an observer keeps what its row's forwards left.

    known = named_observers.registry(["margin=mypkg.watch:Margin"])   # {name: class}
    observers = named_observers.resolve(["margin"], known)           # fresh instances, in order
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lmtrace import registered
from lmtrace.decode.observers import Observer, checked
from lmtrace.errors import InvalidParameter

KIND = registered.Kind("observer", "observers", "NAME=module:Class", "--observer")
Factory = Callable[[], Observer]


def registry(specs: Iterable[str] | Mapping[str, Any] | None) -> dict[str, Factory]:
    """{name: class} from `NAME=module:Class` specs, or from a mapping whose values are classes
    or `module:Class` strings; each name once. Each makes one Observer now, to be checked (an
    Observer, a name of its own) at start-up rather than at a request."""
    known = registered.registry(specs, KIND)
    for name, factory in known.items():
        try:
            made = factory()
        except TypeError as e:  # it needs arguments
            raise InvalidParameter(f"observer: {name} must make an lmtrace.Observer with no arguments ({e})") from e
        if not isinstance(made, Observer):
            raise InvalidParameter(f"observer: {name} must make an lmtrace.Observer, got {type(made).__name__}")
        checked([made])
    return known


def registered_of(processors: Any, observers: Any) -> registered.Registered:
    """The processors' and the observers' registries from their specs (or mappings)."""
    from lmtrace.logits import named

    return registered.Registered(named.registry(processors), registry(observers))


def names(given: Any, known: Mapping[str, Factory]) -> list[str]:
    """The names a request gives, checked (refused in one line naming `observers`)."""
    return registered.check(given, known, KIND)


def resolve(given: Any, known: Mapping[str, Factory]) -> list[Observer]:
    """A fresh instance of each observer a request names, in its order."""
    return [known[n]() for n in names(given, known)]
