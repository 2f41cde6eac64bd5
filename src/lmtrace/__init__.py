"""lmtrace: see inside a language model's decoding, token by token.

The public names are imported when first used (PEP 562), so that `import lmtrace` and the
command line's --help and argument errors do not pay for importing torch and transformers."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

from lmtrace import records
from lmtrace.scoring.variants import spec as variant_spec

# public name -> the module that defines it
_NAMES = {
    "Branches": "lmtrace.decode.branch",
    "branch": "lmtrace.decode.branch",
    "compare": "lmtrace.comparison.core",
    "GenerationError": "lmtrace.errors",
    "InvalidParameter": "lmtrace.errors",
    "LmtraceError": "lmtrace.errors",
    "ModelLoadError": "lmtrace.errors",
    "LabResult": "lmtrace.kvlab",
    "kvlab": "lmtrace.kvlab",
    "intervene": "lmtrace.interventions",
    "steer_vector": "lmtrace.interventions",
    "from_generate": "lmtrace.external.from_generate",
    "LM": "lmtrace.model.lm",
    "load": "lmtrace.model.load",
    "LoadOptions": "lmtrace.model.options",
    "batch_invariant": "lmtrace.model.invariant.mode",
    "SamplingParams": "lmtrace.params",
    "Alternative": "lmtrace.records",
    "Candidate": "lmtrace.records",
    "Step": "lmtrace.records",
    "TokenScore": "lmtrace.records",
    "Trace": "lmtrace.records",
    "rescore": "lmtrace.scoring.teacher.rescore",
    "rollouts": "lmtrace.scoring.rollouts.report",
    "ScoreResult": "lmtrace.scoring.teacher.score",
    "score": "lmtrace.scoring.teacher.score",
    "score_batch": "lmtrace.scoring.teacher.score",
    "kld": "lmtrace.scoring.kld",
    "StabilityResult": "lmtrace.scoring.stability.ledger",
    "stability": "lmtrace.scoring.stability.ledger",
    "encode_prompt": "lmtrace.decode.tracing",
    "generate": "lmtrace.decode.tracing",
    "GenerateOptions": "lmtrace.decode.options",
    "generate_steps": "lmtrace.decode.tracing",
    "stream": "lmtrace.decode.tracing",
    "Observer": "lmtrace.decode.observers",
    "StopRow": "lmtrace.decode.row_state",
    "Uncertainty": "lmtrace.decode.uncertainty",
    "SampleResult": "lmtrace.samples.run",
    "sample": "lmtrace.samples.run",
    "CacheMisuseWarning": "lmtrace.external.watch",
    "watch": "lmtrace.external.watch",
}

if TYPE_CHECKING:
    from lmtrace.comparison.core import compare  # noqa: F401
    from lmtrace.decode.branch import Branches, branch  # noqa: F401
    from lmtrace.decode.observers import Observer  # noqa: F401
    from lmtrace.decode.options import GenerateOptions  # noqa: F401
    from lmtrace.decode.row_state import StopRow  # noqa: F401
    from lmtrace.decode.tracing import encode_prompt, generate, generate_steps, stream  # noqa: F401
    from lmtrace.decode.uncertainty import Uncertainty  # noqa: F401
    from lmtrace.errors import GenerationError, InvalidParameter, LmtraceError, ModelLoadError  # noqa: F401
    from lmtrace.external.from_generate import from_generate  # noqa: F401
    from lmtrace.external.watch import CacheMisuseWarning, watch  # noqa: F401
    from lmtrace.interventions import intervene, steer_vector  # noqa: F401
    from lmtrace.kvlab import LabResult, kvlab  # noqa: F401
    from lmtrace.model.lm import LM  # noqa: F401
    from lmtrace.model.load import load  # noqa: F401
    from lmtrace.model.options import LoadOptions  # noqa: F401
    from lmtrace.params import SamplingParams  # noqa: F401
    from lmtrace.records import Alternative, Candidate, Step, TokenScore, Trace  # noqa: F401
    from lmtrace.samples.run import SampleResult, sample  # noqa: F401
    from lmtrace.scoring.kld import kld  # noqa: F401
    from lmtrace.scoring.rollouts.report import rollouts  # noqa: F401
    from lmtrace.scoring.stability.ledger import StabilityResult, stability  # noqa: F401
    from lmtrace.scoring.teacher.rescore import rescore  # noqa: F401
    from lmtrace.scoring.teacher.score import ScoreResult, score, score_batch  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:  # a submodule (lmtrace.model.load, lmtrace.kv.ledger, ...), as an eager import made them
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'lmtrace' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


class _Package(types.ModuleType):
    """`lmtrace.kvlab` is a function that shares its name with a subpackage; importing the
    subpackage binds it on the package, which would hide the function. The binding is skipped
    (the subpackage stays in sys.modules, where imports find it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def _notebook_html(obj: Any) -> str:
    # imported when a notebook first shows a record: the records themselves import no renderer
    from lmtrace.render.html.trace import notebook_html

    return notebook_html(obj)


records.set_notebook_view(_notebook_html)


def _engine(module: str) -> Any:
    """The `engine:NAME` variant of lmtrace.stability, whose family (vllm/) sits above the
    ledger's: named here by module, as the public names are, and imported when one first runs."""

    def make(lm: Any, spec: Any) -> Any:
        return importlib.import_module(module).world(lm, spec)

    return make


variant_spec.register_engine("vllm", _engine("lmtrace.vllm.variant"))


__all__ = sorted(_NAMES, key=str.lower)
__version__ = "0.1.0"
