"""Fused packed projections: an attention block's q, k and v (and an MLP's gate and up) read the
same input, so their 4-bit blocks are stacked into one matrix and multiplied in one kernel call
(one bfloat16 conversion of the input, one call instead of three): the first of them computes
the whole product, the others take their slice of it. Each output element is the same dot
product over the same groups as before; only the number of calls changes.

The parts stay the model's own modules (`q_proj`, `k_proj`, ...), so the model's forward is
untouched; a part called with another input than the one the product was made from computes
the product again."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lmtrace.model.gguf.blocks import Int4Form
from lmtrace.model.gguf.packed import PackedHead, PackedLinear

# sibling projections that share their input, by the names transformers gives them
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def stack(forms: Sequence[Int4Form]) -> Int4Form:
    """One form whose output rows are the forms' rows, one after another."""
    return Int4Form(
        codes=torch.cat([f.codes for f in forms], dim=0),
        scales=torch.cat([f.scales for f in forms], dim=1),  # (groups, out)
        zeros=torch.cat([f.zeros for f in forms], dim=1),
        doubled=forms[0].doubled,
    )


class FusedPacked(PackedLinear):
    """The stacked projection; `product(x)` gives each part's slice of x W^T, computed once per input."""

    def __init__(self, form: Int4Form, sizes: list[int], compute_dtype: torch.dtype, kind: str, source: str):
        super().__init__(form, None, compute_dtype, kind, source)
        self.sizes = sizes
        self.packed_numel = 0  # the parts' weights, counted by the parts
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def product(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x is not self._input:
            self._parts = super().forward(x).split(self.sizes, dim=-1)  # (..., sum) -> each (..., size)
            self._input = x
        return self._parts


class PackedPart(nn.Module):
    """One projection of a FusedPacked: its slice of the stacked product, plus its own bias."""

    def __init__(self, fused: FusedPacked, index: int, original: PackedLinear):
        super().__init__()
        self.fused, self.index = fused, index
        self.in_features, self.out_features = original.in_features, original.out_features
        self.kind, self.source, self.packed_numel = original.kind, original.source, original.packed_numel
        self.bias = original.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fused.product(x)[self.index]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.kind}, part {self.index} of the fused {self.fused.kind}, out={self.out_features}"


def fuse(model: nn.Module, form_of: Callable[[str, PackedLinear], Int4Form]) -> int:
    """Stacks every group of sibling packed projections (GROUPS) that share an input width and a
    kernel form; `form_of(name, layer)` reads a layer's blocks again. Returns the groups fused."""
    fused = 0
    for name, parent in list(model.named_modules()):
        for group in GROUPS:
            layers = [getattr(parent, g, None) for g in group]
            if not all(type(layer) is PackedLinear for layer in layers):
                continue
            first = layers[0]
            if any((x.in_features, x.doubled, x.compute_dtype) != (first.in_features, first.doubled,
                                                                 first.compute_dtype) for x in layers):  # fmt: skip
                continue
            names = [f"{name}.{g}" if name else g for g in group]
            form = stack([form_of(n, layer) for n, layer in zip(names, layers)])
            kind = "+".join(dict.fromkeys(x.kind for x in layers))
            whole = FusedPacked(form, [x.out_features for x in layers], first.compute_dtype, kind,
                                "+".join(x.source for x in layers))  # fmt: skip
            for index, (g, layer) in enumerate(zip(group, layers)):
                setattr(parent, g, PackedPart(whole, index, layer))
            fused += 1
    return fused


def is_packed(module: nn.Module) -> bool:
    """A module whose weights run packed: a PackedLinear (not the head) or a part of a fused one."""
    return isinstance(module, PackedPart) or (isinstance(module, PackedLinear) and not isinstance(module, PackedHead))
