"""Which kernel computes the float32 linear layers on the CPU: torch's default (MKL's sgemm), or
oneDNN with each weight packed once into the kernel's own blocked layout (`matmul="onednn"`,
CLI `--matmul onednn`).

Why: MKL's sgemm lays the weight out again on every call. One row (a matrix-vector product) reads
the weight once, but 2-16 rows, a batch step, cost two to three times one row on this kind of CPU,
although the step reads the same weights. oneDNN with the weight packed ahead computes 8 rows in
about one row's time; vLLM's CPU backend runs its linear layers the same way. The numbers are the
same model's in float32, summed in another order: logprobs move by float32 rounding (the bound
measured against transformers is in docs/performance.md and tested), as between a batch and one
row alone. The default stays torch's own kernel, the one transformers' numbers come from.

A packed copy is made once per layer and made again when the weight changes (an in-place edit
bumps the tensor's version; a new tensor has another address), so an edited model never runs
stale weights. The packed copies take as much memory again as the float32 weights they pack.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lmtrace.errors import InvalidParameter

MATMULS = ("default", "onednn")
# the batch size oneDNN lays the weight out for; any batch runs on it (measured: batch 1 as fast as
# with a batch-1 layout, batch 16 as fast as with a batch-16 one)
_LAYOUT_ROWS = 8


@dataclass
class Packed:
    """A linear layer's weight in oneDNN's layout, and which weight it was made from."""

    weight: torch.Tensor
    version: int
    address: int


def check(matmul: str) -> None:
    if matmul not in MATMULS:
        raise InvalidParameter(f"matmul must be one of {', '.join(MATMULS)}, got {matmul!r}")


def use(model: Any, matmul: str) -> int:
    """Runs the model's float32 CPU linear layers through `matmul` ("default": torch's own kernel
    again); returns how many layers it switched. Packed (quantized) layers and layers in another
    dtype or on another device keep their own kernel."""
    check(matmul)
    switched = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:  # packed GGUF layers are other classes
            continue
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) is _onednn_forward:
            del module.forward
            module._lmtrace_onednn = None
        if matmul == "onednn" and _eligible(module):
            module._lmtrace_onednn = None
            module.forward = types.MethodType(_onednn_forward, module)
            switched += 1
    if matmul == "onednn" and switched == 0:
        raise InvalidParameter("matmul: 'onednn' runs float32 linear layers on the CPU; this model has none")
    model.lmtrace_matmul = f"onednn ({switched} linear layers)" if matmul == "onednn" else None
    return switched


def describe(model: Any) -> str | None:
    """'onednn (211 linear layers)' where `use` switched the model's layers, else None."""
    return getattr(model, "lmtrace_matmul", None)


def _eligible(module: torch.nn.Linear) -> bool:
    w = module.weight
    return w.dtype == torch.float32 and w.device.type == "cpu" and torch.backends.mkldnn.is_available()


def _packed(module: torch.nn.Linear) -> torch.Tensor:
    """The layer's weight in oneDNN's layout, packed again where the weight changed."""
    w = module.weight
    p: Packed | None = getattr(module, "_lmtrace_onednn", None)
    if p is None or p.version != w._version or p.address != w.data_ptr():
        with torch.inference_mode(False), torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _LAYOUT_ROWS)
        p = Packed(packed, w._version, w.data_ptr())
        module._lmtrace_onednn = p
    return p.weight


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.requires_grad or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)  # autograd (attribution's gradients) or another dtype
    rows = x.reshape(-1, x.shape[-1])  # (..., in) -> (rows, in)
    y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), _packed(self), self.bias, "none", [], "")
    return y.reshape(*x.shape[:-1], y.shape[-1])  # (rows, out) -> (..., out)
