"""Library versions recorded in every trace header."""

from __future__ import annotations

import platform
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version


@lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("lmtrace", "torch", "transformers", "tokenizers"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return dict(found)
