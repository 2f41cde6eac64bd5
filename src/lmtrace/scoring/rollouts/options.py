"""The options of `lmtrace rollouts` checked before any model loads (no torch here): the caps,
the --locate variant, its threshold. Each error names the option and the value."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.scoring.variants.spec import VariantSpec

# the variants with a model or a setting of their own to hook
LOCATE_KINDS = ("dtype", "weights", "attention", "threads", "model", "lm_head")


def check_caps(caps: Sequence[Any]) -> list[float]:
    """Each cap a number > 1 (a cap of C bounds the ratio to [1/C, C])."""
    out = []
    for c in caps:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 1:
            raise InvalidParameter(f"cap must be a number > 1 (the ratio is bounded to [1/C, C]), got {c!r}")
        out.append(float(c))
    return out


def check_threshold(threshold: Any) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
        raise InvalidParameter(f"locate_threshold must be a number > 0, got {threshold!r}")


def check_locate(spec: VariantSpec) -> None:
    if spec.kind not in LOCATE_KINDS:
        raise InvalidParameter(
            f"locate: {spec.spec!r} has no model of its own to compare layer by layer "
            f"(use a {', '.join(k + ':' for k in LOCATE_KINDS)} variant)"
        )
