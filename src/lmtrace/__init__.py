"""lmtrace: see inside a language model's decoding, token by token."""

from lmtrace.branch import Branches, branch
from lmtrace.comparison import compare
from lmtrace.errors import GenerationError, InvalidParameter, LmtraceError, ModelLoadError
from lmtrace.from_generate import from_generate
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
    "from_generate",
    "generate",
    "generate_steps",
    "load",
    "rescore",
    "score",
    "score_batch",
    "stream",
    "watch",
]
__version__ = "0.1.0"
