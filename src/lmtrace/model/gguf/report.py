"""What a packed load did (`PackReport`): which linear layers run packed and at which GGUF type,
which keep float weights and why; the load's status line, the trace's weights field and
verify's report all read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn


@dataclass
class PackReport:
    """What `pack_gguf` did: which layers run packed (at which GGUF type), which keep float
    weights and why."""

    packed: dict[str, str] = field(default_factory=dict)  # module name -> GGUF type
    kept_float: dict[str, str] = field(default_factory=dict)  # module name -> reason
    compute_dtype: str = "bfloat16"
    kernel: str = "torch's"  # whose int4 kernel multiplies: torch's, or lmtrace's (model/fused/int4.c)
    path: str = ""  # the GGUF file
    architecture: str | None = None  # the file's general.architecture
    packed_bytes: int = 0  # bytes of the packed matmul weights
    float_bytes: int = 0  # bytes of the linear weights kept in float
    seconds: float = 0.0
    embedding: str = ""  # how the input embedding is held (a packed load: model/gguf/embedding.py)
    fused: int = 0  # groups of sibling projections stacked into one kernel call (model/gguf/fused.py)
    joined: int = 0  # attention modules whose q/k/v run as one call of lmtrace's kernel (model/gguf/joined.py)
    layers: int = 0  # decoder layers computed as one function over the packed products (model/layer_path.py)
    # of those, the layers whose small operations (RMSNorm, rotary, SiLU·mul, the decode step's
    # attention) run in C: every one on lmtrace's kernel (model/fused)
    small_ops: int = 0

    def types(self) -> str:
        """e.g. "Q4_K x27, Q5_0 x81, Q6_K x9, Q8_0 x11": the GGUF types that run packed."""
        counts: dict[str, int] = {}
        for kind in self.packed.values():
            counts[kind] = counts.get(kind, 0) + 1
        return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))

    def line(self) -> str:
        """One line for the load status: what runs packed, at which types, and what does not."""
        total = len(self.packed) + len(self.kept_float)
        text = (
            f"packed weights: {len(self.packed)} of {total} linear layers ({self.types()}; "
            f"{self.packed_bytes / 1e6:.0f} MB, {self.compute_dtype} activations, {self.kernel} kernel"
        )
        text += f", {self.small_ops} layers' small operations in C)" if self.small_ops else ")"
        if self.embedding:
            text += f"; embedding: {self.embedding}"
        if self.kept_float:
            reasons = sorted({f"{n} ({r})" for n, r in self.kept_float.items()})
            text += f"; kept in float: {', '.join(reasons[:3])}" + (" …" if len(reasons) > 3 else "")
        return text

    def short(self) -> str:
        """e.g. "packed (Q4_1 x210, Q8_0 x1), float32 activations, lmtrace's kernel, 30 layers' small
        operations in C; kept float: 1" """
        text = f"packed ({self.types()}), {self.compute_dtype} activations, {self.kernel} kernel"
        if self.small_ops:
            text += f", {self.small_ops} layers' small operations in C"
        return text + (f"; kept float: {len(self.kept_float)}" if self.kept_float else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def report_of(model: nn.Module) -> PackReport | None:
    """The PackReport of a packed model, None for a float one."""
    return getattr(model, "lmtrace_packed", None)
