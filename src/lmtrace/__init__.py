"""lmtrace: see inside a language model's decoding, token by token."""

from lmtrace.branch import Branches, branch
from lmtrace.comparison import compare
from lmtrace.errors import GenerationError, InvalidParameter, LmtraceError, ModelLoadError
from lmtrace.kvlab import LabResult, kvlab  # the function shadows the package name on purpose
from lmtrace.loading import LM, load
from lmtrace.params import SamplingParams
from lmtrace.records import Alternative, Candidate, Step, TokenScore, Trace
from lmtrace.rescore import rescore
from lmtrace.score import ScoreResult, score, score_batch
from lmtrace.tracing import encode_prompt, generate, generate_steps, stream
from lmtrace.watch import CacheMisuseWarning, watch

__all__ = [
    "LM",
    "Alternative",
    "CacheMisuseWarning",
    "Branches",
    "Candidate",
    "GenerationError",
    "InvalidParameter",
    "LabResult",
    "LmtraceError",
    "ModelLoadError",
    "SamplingParams",
    "compare",
    "ScoreResult",
    "Step",
    "TokenScore",
    "Trace",
    "branch",
    "encode_prompt",
    "generate",
    "generate_steps",
    "kvlab",
    "load",
    "rescore",
    "score",
    "score_batch",
    "stream",
    "watch",
]
__version__ = "0.1.0"
