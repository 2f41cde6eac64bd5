"""q, k and v in one call of lmtrace's int4 kernel: the three packed layers read the same input, so
their code words and scales are made views of one pair of buffers (no second copy) and one kernel
call gives their outputs side by side. The kernel makes every output column apart, the same chain
of multiply-adds whatever the columns beside it, so each layer's numbers are those it gives alone
(tests/test_int4_kernel.py). Used by the decoder layers computed as one function
(lmtrace.model.layer_path); transformers' forward still calls each layer, on its views.

Joined only where each layer runs on lmtrace's kernel, without a bias, with the same input and
pieces, bits and scale groups and a whole number of the kernel's 64-column panels (no padding between them)."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.model.gguf.nibbles import PANEL
from lmtrace.model.gguf.packed import PackedLinear

ATTRIBUTE = "_lmtrace_qkv"  # where an attention module keeps its Joined


class Joined:
    """Packed layers whose buffers are views of one (codes, scale_zeros) pair."""

    def __init__(self, layers: list[PackedLinear]) -> None:
        self.layers = tuple(layers)
        self.codes = torch.cat([layer.packed for layer in layers])
        self.scale_zeros = torch.cat([layer.scale_zeros for layer in layers], 1)
        self.pieces, self.bits, self.group = layers[0].pieces, layers[0].bits, layers[0].group
        at = 0
        for layer in layers:
            panels = layer.packed.shape[0]
            layer.packed = self.codes[at : at + panels]
            layer.scale_zeros = self.scale_zeros[:, at : at + panels]
            at += panels
        self.addresses = tuple(layer.packed.data_ptr() for layer in layers)

    def holds(self, layers: tuple[Any, ...]) -> bool:
        """Whether `layers` are still these, on these buffers (not replaced, moved or repacked)."""
        return all(a is b for a, b in zip(layers, self.layers)) and all(
            layer.packed.data_ptr() == address for layer, address in zip(layers, self.addresses)
        )

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """(rows, sum of the layers' outputs) float32 for a `PackedLinear.prepared` input."""
        from lmtrace.model.fused import ops

        return ops.int4_mm(flat, self.codes, self.scale_zeros, self.pieces, self.bits, self.group)


def joinable(layers: list[Any]) -> bool:
    first = layers[0]
    return all(
        type(layer) is PackedLinear
        and layer.own_kernel
        and layer.bias is None
        and layer.out_features % PANEL == 0
        and (layer.in_features, layer.pieces, layer.bits, layer.group)
        == (first.in_features, first.pieces, first.bits, first.group)
        for layer in layers
    )


def join_attention(model: torch.nn.Module) -> int:
    """Joins q/k/v of every attention module where `joinable`; returns how many were joined."""
    joined = 0
    for module in model.modules():
        parts = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if all(p is not None for p in parts) and joinable(parts):
            setattr(module, ATTRIBUTE, Joined(parts))  # a plain attribute: not a submodule, no buffers
            joined += 1
    return joined


def joined_of(attention: Any) -> Joined | None:
    """The attention module's Joined q/k/v where they are still joined."""
    joined = attention.__dict__.get(ATTRIBUTE)
    parts = (attention._modules["q_proj"], attention._modules["k_proj"], attention._modules["v_proj"])
    return joined if joined is not None and joined.holds(parts) else None
