"""vLLM as an engine of lmtrace (`lmtrace batch --engine vllm`, lmtrace.vllm.VLLMEngine): the
same traces from vLLM's decoding, with lmtrace's teacher-forced rescoring as their check.
Needs the `vllm` extra; vLLM itself is imported only when an engine starts."""

from lmtrace.vllm.convert import Request, provenance, to_trace
from lmtrace.vllm.engine import VLLMEngine

__all__ = ["Request", "VLLMEngine", "provenance", "to_trace"]
