"""The KV-cache lab: what compressing the cache (evicting positions, quantizing them) costs,
token by token, against the full cache. See `lmtrace.kvlab.lab.kvlab`."""

from lmtrace.kvlab.lab import LabOptions, LabResult, kvlab
from lmtrace.kvlab.spec import POLICIES, known, parse_policies, parse_policy

__all__ = ["POLICIES", "LabOptions", "LabResult", "known", "kvlab", "parse_policies", "parse_policy"]
