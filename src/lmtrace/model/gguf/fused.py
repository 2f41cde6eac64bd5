"""A fused packed MLP: a Llama-style MLP's gate and up projections read the same input, so their
4-bit blocks are stacked into one matrix and multiplied in one kernel call (one bfloat16
conversion of the input, one call instead of two). Each output element is the same dot product
over the same groups as before: the fused MLP is checked to give the model's own MLP output,
bit for bit, before it replaces it. Stateless, so torch.compile traces it like any module.

(q/k/v are not stacked here: their products feed the attention's own forward, which would have
to be rewritten or handed a cached product; a cache keyed on the input recompiled torch.compile's
graph at every step. On lmtrace's kernel they are joined instead, their buffers views of one pair,
for the decoder layers lmtrace.model.layer_path computes as one function: model/gguf/joined.py.)"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmtrace.model.gguf.blocks import Int4Form
from lmtrace.model.gguf.packed import PackedLinear
from lmtrace.model.gguf.tensors import trim_heap


def stack(forms: list[Int4Form]) -> Int4Form:
    """One form whose output rows are the forms' rows, one after another."""
    return Int4Form(
        codes=torch.cat([f.codes for f in forms], dim=0),
        scales=torch.cat([f.scales for f in forms], dim=1),  # (groups, out)
        zeros=torch.cat([f.zeros for f in forms], dim=1),
        pieces=forms[0].pieces,
    )


class Stub(nn.Module):
    """Where a fused projection was in the MLP kept for float_reference: its shape and GGUF tensor."""

    def __init__(self, layer: PackedLinear):
        super().__init__()
        self.in_features, self.out_features, self.source, self.bias, self.order = (
            layer.in_features,
            layer.out_features,
            layer.source,
            layer.bias,
            layer.order,
        )


class FusedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one packed matrix. `original` is the MLP it
    replaced, its gate and up as Stubs (lmtrace.model.gguf.packed.float_reference puts it back)."""

    def __init__(
        self, gate_up: PackedLinear, down: nn.Module, act_fn: nn.Module, gate: PackedLinear, up: PackedLinear
    ) -> None:
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn = gate_up, down, act_fn
        self.sizes = [gate.out_features, up.out_features]
        self.biases = (gate.bias, up.bias)
        self.sources = (gate.source, up.source)  # the GGUF tensors, for float_reference
        gate_up.packed_numel = gate.packed_numel + up.packed_numel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.sizes, dim=-1)  # (..., gate + up) -> two (..., size)
        if self.biases[0] is not None:
            gate = gate + self.biases[0]
        if self.biases[1] is not None:
            up = up + self.biases[1]
        return self.down_proj(self.act_fn(gate) * up)


def fuse(model: nn.Module, form_of: Callable[[str, PackedLinear], Int4Form]) -> int:
    """Replaces every MLP whose gate_proj and up_proj run packed alike by a FusedMLP, where the
    fused one gives the MLP's own output on a test input; `form_of(name, layer)` reads a layer's
    blocks again. Returns the MLPs fused."""
    fused = 0
    for name, mlp in list(model.named_modules()):
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        down, act = getattr(mlp, "down_proj", None), getattr(mlp, "act_fn", None)
        if type(gate) is not PackedLinear or type(up) is not PackedLinear or down is None or act is None:
            continue
        alike = [(m.in_features, m.pieces, m.bits, m.group, m.compute_dtype) for m in (gate, up)]
        if alike[0] != alike[1]:
            continue
        prefix = f"{name}." if name else ""
        form = stack([form_of(prefix + "gate_proj", gate), form_of(prefix + "up_proj", up)])
        gate_up = PackedLinear(form, None, gate.compute_dtype, f"{gate.kind}+{up.kind}", f"{gate.source}+{up.source}")
        candidate = FusedMLP(gate_up, down, act, gate, up)
        probe = torch.randn(2, gate.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            if not torch.equal(candidate(probe), mlp(probe)):  # an MLP of another form: left as it is
                continue
        mlp.gate_proj, mlp.up_proj = Stub(gate), Stub(up)
        candidate.__dict__["original"] = mlp  # not a submodule: no second copy in state_dict or modules()
        model.set_submodule(name, candidate)
        del gate, up, candidate, gate_up, form
        trim_heap()  # the two layers' blocks, now in the fused one, out of the peak
        fused += 1
    return fused
