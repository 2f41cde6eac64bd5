"""Check the logprobs another engine reported against the model's own (see core.compare)."""

from lmtrace.comparison.core import Comparison, compare
from lmtrace.comparison.parse import Reported, parse_response

__all__ = ["Comparison", "Reported", "compare", "parse_response"]
