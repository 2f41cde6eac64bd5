"""Variant specs of the stability ledger, parsed and checked before any model loads (no torch
here): `dtype:bfloat16`, `weights:packed`, `attention:eager`, `batch:4`, `threads:1`,
`compile`, `engine:vllm`, `model:PATH`, `lm_head:float32`. Every error names the parameter and the value.

An engine above this family (lmtrace.vllm) runs its variant through `register_engine`, called
from the package's __init__, so that this family never imports one above it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrace import arguments
from lmtrace.errors import InvalidParameter

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flex_attention")
ENGINES = ("vllm",)
# kind -> what its value is, for the messages and --help
KINDS = {
    "dtype": "one of " + ", ".join(DTYPES),
    "weights": "packed (a GGUF's own 4-bit weights)",
    "attention": "one of " + ", ".join(ATTENTION),
    "batch": "a whole number N >= 2 (the prompt as one row of N, left-padded)",
    "threads": "a whole number N >= 1 (torch.set_num_threads)",
    "compile": "no value",
    "engine": "one of " + ", ".join(ENGINES),
    "model": "the path of another model file or folder (the same tokenizer)",
    "lm_head": "float32 (the model in bfloat16, its lm_head in float32, as RL trainers run it)",
}
DEFAULT = ("dtype:bfloat16", "weights:packed", "attention:eager", "batch:4", "threads:1")

# engine name -> a function (lm, spec) -> a World (lmtrace.scoring.variants.worlds.World)
_ENGINES: dict[str, Callable[[Any, VariantSpec], Any]] = {}


@dataclass(frozen=True)
class VariantSpec:
    """One variant: its kind (`dtype`, `batch`, ...), its value ("bfloat16", 4, a path, or None
    for `compile`) and the spec as written back (`dtype:bfloat16`)."""

    kind: str
    value: Any = None

    @property
    def spec(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value}"


def _bad(spec: str, why: str) -> InvalidParameter:
    return InvalidParameter(f"variant: {spec!r} {why}")


def _whole(spec: str, raw: str, low: int) -> int:
    if not raw.strip().isdigit() or int(raw) < low:
        raise _bad(spec, f"needs a whole number >= {low}, got {raw!r}")
    return int(raw)


def parse_variant(spec: str | VariantSpec) -> VariantSpec:
    """`dtype:bf16` -> VariantSpec("dtype", "bfloat16"); a VariantSpec passes through."""
    if isinstance(spec, VariantSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidParameter(f"variant: a spec such as 'dtype:bfloat16' is needed, got {spec!r}")
    kind, colon, raw = spec.strip().partition(":")
    kind, raw = kind.strip().lower(), raw.strip()
    if kind not in KINDS:
        raise InvalidParameter(f"variant: unknown kind {kind!r} in {spec!r} (known: {', '.join(KINDS)})")
    if kind == "compile":
        if colon:
            raise _bad(spec, "takes no value: write 'compile'")
        return VariantSpec("compile")
    if not raw:
        raise _bad(spec, f"needs a value after '{kind}:': {KINDS[kind]}")
    if kind == "dtype":
        name = arguments.DTYPE_NAMES.get(raw.lower())
        if name is None:
            raise _bad(spec, f"needs {KINDS[kind]}, got {raw!r}")
        return VariantSpec(kind, name)
    if kind in ("batch", "threads"):
        return VariantSpec(kind, _whole(spec, raw, 2 if kind == "batch" else 1))
    if kind == "model":
        if not Path(raw).expanduser().exists():
            raise _bad(spec, f"names no file or folder: {raw!r}")
        return VariantSpec(kind, raw)
    choices = {"weights": ("packed",), "attention": ATTENTION, "engine": ENGINES, "lm_head": ("float32",)}[kind]
    if raw.lower() not in choices:
        raise _bad(spec, f"needs {KINDS[kind]}, got {raw!r}")
    return VariantSpec(kind, raw.lower())


def parse_variants(specs: Sequence[str | VariantSpec]) -> list[VariantSpec]:
    """Every spec parsed; at least one, none twice."""
    if not specs:
        raise InvalidParameter("variant: give at least one variant (e.g. --variant dtype:bfloat16)")
    parsed = [parse_variant(s) for s in specs]
    seen: set[str] = set()
    for v in parsed:
        if v.spec in seen:
            raise InvalidParameter(f"variant: {v.spec!r} is given twice")
        seen.add(v.spec)
    return parsed


def register_engine(name: str, make: Callable[[Any, VariantSpec], Any]) -> None:
    """Says how `engine:NAME` runs: `make(lm, spec)` returns its World (called from above)."""
    _ENGINES[name] = make


def engine(name: str) -> Callable[[Any, VariantSpec], Any] | None:
    """The registered maker of `engine:NAME`, or None."""
    return _ENGINES.get(name)
