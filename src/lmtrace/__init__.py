"""lmtrace: see inside a language model's decoding, token by token.

The public names are imported when first used (PEP 562), so that `import lmtrace` and the
command line's --help and argument errors do not pay for importing torch and transformers."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_NAMES = {
    "Branches": "lmtrace.branch",
    "branch": "lmtrace.branch",
    "compare": "lmtrace.comparison",
    "GenerationError": "lmtrace.errors",
    "InvalidParameter": "lmtrace.errors",
    "LmtraceError": "lmtrace.errors",
    "ModelLoadError": "lmtrace.errors",
    "from_generate": "lmtrace.from_generate",
    "LM": "lmtrace.loading",
    "load": "lmtrace.loading",
    "SamplingParams": "lmtrace.params",
    "Alternative": "lmtrace.records",
    "Candidate": "lmtrace.records",
    "Step": "lmtrace.records",
    "TokenScore": "lmtrace.records",
    "Trace": "lmtrace.records",
    "rescore": "lmtrace.rescore",
    "ScoreResult": "lmtrace.score",
    "score": "lmtrace.score",
    "score_batch": "lmtrace.score",
    "encode_prompt": "lmtrace.tracing",
    "generate": "lmtrace.tracing",
    "generate_steps": "lmtrace.tracing",
    "stream": "lmtrace.tracing",
    "CacheMisuseWarning": "lmtrace.watch",
    "watch": "lmtrace.watch",
}

if TYPE_CHECKING:
    from lmtrace.branch import Branches, branch  # noqa: F401
    from lmtrace.comparison import compare  # noqa: F401
    from lmtrace.errors import GenerationError, InvalidParameter, LmtraceError, ModelLoadError  # noqa: F401
    from lmtrace.from_generate import from_generate  # noqa: F401
    from lmtrace.loading import LM, load  # noqa: F401
    from lmtrace.params import SamplingParams  # noqa: F401
    from lmtrace.records import Alternative, Candidate, Step, TokenScore, Trace  # noqa: F401
    from lmtrace.rescore import rescore  # noqa: F401
    from lmtrace.score import ScoreResult, score, score_batch  # noqa: F401
    from lmtrace.tracing import encode_prompt, generate, generate_steps, stream  # noqa: F401
    from lmtrace.watch import CacheMisuseWarning, watch  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:  # a submodule (lmtrace.loading, lmtrace.kv, ...), as an eager import made them
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'lmtrace' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


class _Package(types.ModuleType):
    """`lmtrace.score`, `.branch`, `.rescore`, `.watch` are functions that share their names
    with submodules; importing such a submodule binds it on the package, which would hide the
    function. The binding is skipped (the submodule stays in sys.modules, where imports find it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = sorted(_NAMES, key=str.lower)
__version__ = "0.1.0"
