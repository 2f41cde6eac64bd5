"""Checks of a user's arguments that need no torch: the command line runs them before it imports
torch and transformers, so a typo is answered in a fraction of a second, not after a model load."""

from __future__ import annotations

from collections.abc import Callable

from lmtrace.errors import InvalidParameter

# a --dtype name -> the torch dtype's attribute name
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
DEVICES = ("auto", "cpu", "cuda", "mps")


def device(name: str) -> None:
    if name not in DEVICES and not name.startswith("cuda:"):
        raise InvalidParameter(f"device must be one of {', '.join(DEVICES)}, got {name!r}")


def dtype(name: str) -> None:
    if name != "auto" and name not in DTYPE_NAMES:
        raise InvalidParameter(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {name!r}")


def step_selector(waterfall: int | str | None, max_new_tokens: int) -> Callable[[int], bool] | None:
    """`waterfall` as given by a user: a step index, "all", or None (off)."""
    if waterfall is None:
        return None
    if waterfall == "all":
        return lambda index: True
    if isinstance(waterfall, str) and waterfall.strip().isdigit():
        waterfall = int(waterfall)
    if isinstance(waterfall, bool) or not isinstance(waterfall, int) or not 0 <= waterfall < max_new_tokens:
        raise InvalidParameter(
            f"waterfall must be a step index in [0, {max_new_tokens - 1}] or 'all', got {waterfall!r}"
        )
    return lambda index: index == waterfall


MAX_DRAFT_TOKENS = 16


def draft_spec(spec: str) -> str:
    """A --draft SPEC as given: "packed", "layers:N" (N >= 1), or a path / hub id (checked when
    it loads)."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidParameter(f"draft must be 'packed', 'layers:N' or a model path, got {spec!r}")
    if spec.startswith("layers:"):
        n = spec.split(":", 1)[1]
        if not n.strip().isdigit() or int(n) < 1:
            raise InvalidParameter(f"draft: 'layers:N' takes a number of layers N >= 1, got {spec!r}")
    return spec


def draft_tokens(k: int) -> int:
    """--draft-tokens K: proposals per block, in [1, 16]."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidParameter(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
    return k


def draft_alone(lens: bool = False, attention: bool | str = False) -> None:
    """What speculative decoding does not combine with: hooks that expect one position a forward
    (with a draft, `compile` compiles the draft's step)."""
    for name, on in (("lens", lens), ("attention", attention)):
        if on:
            raise InvalidParameter(f"draft: speculative decoding cannot be combined with {name}; drop one of them")
