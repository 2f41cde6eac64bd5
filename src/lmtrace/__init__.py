"""lmtrace: see inside a language model's decoding, token by token."""

from lmtrace.comparison import compare
from lmtrace.errors import GenerationError, InvalidParameter, LmtraceError, ModelLoadError
from lmtrace.loading import LM, load
from lmtrace.params import SamplingParams
from lmtrace.records import Alternative, Step, Trace
from lmtrace.tracing import encode_prompt, generate, generate_steps, stream
from lmtrace.watch import CacheMisuseWarning, watch

__all__ = [
    "LM",
    "Alternative",
    "CacheMisuseWarning",
    "GenerationError",
    "InvalidParameter",
    "LmtraceError",
    "ModelLoadError",
    "SamplingParams",
    "compare",
    "Step",
    "Trace",
    "encode_prompt",
    "generate",
    "generate_steps",
    "load",
    "stream",
    "watch",
]
__version__ = "0.1.0"
