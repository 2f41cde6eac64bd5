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
`matmul="onednn-fused"` is oneDNN's products with the Llama layers' small operations between them
(RMSNorm, the residual add, rotary, SiLU·mul) computed in C: lmtrace.model.fused.

A packed copy is made once per layer and made again when the weight changes (an in-place edit
bumps the tensor's version; a new tensor has another address), so an edited model never runs
stale weights. The packed copies take as much memory again as the float32 weights they pack.

Layers that read the same input (an attention's q/k/v, an MLP's gate/up) are also packed together
as one matrix: the first of them called computes all their outputs in one call, and each of the
others, called with that same input, takes its part. A group is formed only where each part
equals the layer's own product bit for bit (checked on a test input when `use` switches it), and
a layer called with another input computes its own, so hooks and edits see what they would alone.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lmtrace.errors import InvalidParameter

MATMULS = ("default", "onednn", "onednn-fused")
# the batch size oneDNN lays the weight out for; any batch runs on it (measured on 60 cold 1536 x 576
# weights: at 8 and 16 rows the fastest of the layouts for 1, 8, 16 and 32 rows; at 1 row 12% slower
# than the layout for 1, and still as fast as torch's own kernel there)
_LAYOUT_ROWS = 8


@dataclass
class Group:
    """Layers that read one input, packed as one matrix (their weights stacked by output rows)."""

    layers: list[torch.nn.Linear]
    packed: Packed | None = None
    stash: tuple[torch.Tensor, int, list[torch.Tensor | None]] | None = None  # (input, its version, parts)

    def weights(self) -> tuple[tuple[int, int], ...]:
        return tuple((m.weight._version, m.weight.data_ptr()) for m in self.layers)


@dataclass
class Packed:
    """A linear layer's weight in oneDNN's layout, and which weight it was made from."""

    weight: torch.Tensor
    version: Any  # the weight's version (a group's: every layer's version and address)
    address: int
    bias: torch.Tensor | None = None


def check(matmul: str) -> None:
    if matmul not in MATMULS:
        raise InvalidParameter(f"matmul must be one of {', '.join(MATMULS)}, got {matmul!r}")


def use(model: Any, matmul: str) -> int:
    """Runs the model's float32 CPU linear layers through `matmul` ("default": torch's own kernel
    again; "onednn-fused": oneDNN's, and the decoder layers' small operations in C, see
    lmtrace.model.fused); returns how many layers it switched. Packed (quantized) layers and layers
    in another dtype or on another device keep their own kernel."""
    check(matmul)
    from lmtrace.model import layer_path
    from lmtrace.model.fused import build as fused_build

    layer_path.remove(model)
    switched = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:  # packed GGUF layers are other classes
            continue
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) is _onednn_forward:
            del module.forward
            module._lmtrace_onednn = module._lmtrace_group = None
        if matmul != "default" and _eligible(module):
            module._lmtrace_onednn = module._lmtrace_group = None
            module.forward = types.MethodType(_onednn_forward, module)
            switched += 1
    if matmul != "default" and switched == 0:
        layer_path.install(model)  # a packed model's layers keep their own path
        raise InvalidParameter(
            f"matmul: {matmul!r} runs float32 linear layers on the CPU; this model has none "
            "(its weights packed, in another dtype or on another device)"
        )
    grouped = _group(model) if matmul != "default" else 0
    fused = matmul == "onednn-fused"
    if fused:
        fused_build.library()  # compiled now: no compiler is one line here, not an error mid-decode
    lean = layer_path.install(model, fused=fused)  # onednn's grouped layers (or a packed model's, whatever matmul)
    what = f"{switched} linear layers, {grouped} groups, {lean} decoder layers in one function"
    count = layer_path.fused_layers(model)
    if fused and count == 0:  # onednn-fused would be onednn: said in one line, not silently
        use(model, "default")
        raise InvalidParameter(
            "matmul: 'onednn-fused' computes the small operations of Llama decoder layers; this model's "
            f"{_layer_kind(model)} are not such layers (use matmul 'onednn')"
        )
    every = layer_path.fused_layers(model, every=True)  # onednn-fused's, or a packed model's on lmtrace's kernel
    if every:
        what += f", {every} with RMSNorm, rotary, SiLU·mul and decode attention in C"
    if count > every:
        what += f", {count - every} with RMSNorm and rotary in C (torch's bits)"
    model.lmtrace_matmul = f"{matmul} ({what})" if matmul != "default" else None
    return switched


def _layer_kind(model: Any) -> str:
    """The name of the model's decoder layers' class (plural), for a refusal."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return f"{type(layers[0]).__name__}s" if layers else "layers"


# the sibling layers that read one input, by the names transformers' decoder layers give them
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _group(model: Any) -> int:
    """Forms the groups of switched sibling layers whose parts equal their own products."""
    groups = 0
    for parent in model.modules():
        for names in SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            if not all(switched(m) for m in layers) or len({m.in_features for m in layers}) != 1:
                continue
            group = Group(layers)
            probe = torch.randn(3, layers[0].in_features, generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                alone = [m(probe) for m in layers]
                for m in layers:
                    m._lmtrace_group = group
                together = [m(probe) for m in layers]
            if all(torch.equal(a, b) for a, b in zip(alone, together)):
                groups += 1
            else:  # another summation order in the stacked matrix: each layer keeps its own call
                for m in layers:
                    m._lmtrace_group = None
    return groups


def switched(module: Any) -> bool:
    """Whether `use` switched this linear layer to the packed product."""
    return type(module) is torch.nn.Linear and getattr(module.forward, "__func__", None) is _onednn_forward


def grouped(layers: list[torch.nn.Linear]) -> bool:
    """Whether these switched layers form one group, in this order."""
    group = getattr(layers[0], "_lmtrace_group", None)
    return group is not None and group.layers == layers and all(switched(m) for m in layers)


def together(layers: list[torch.nn.Linear], x: torch.Tensor) -> torch.Tensor:
    """The grouped layers' products for `x` (..., in) in one call: (rows, sum of their outputs),
    each layer's part a slice of the last dimension, equal to its own product bit for bit."""
    p = _group_packed(layers[0]._lmtrace_group)  # type: ignore[arg-type]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return torch.ops.mkldnn._linear_pointwise.default(rows, p.weight, p.bias, "none", [], "")


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A switched layer's product for `x` (..., in), as its forward gives it, without a module call."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise.default(rows, _packed(layer), layer.bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def describe(model: Any) -> str | None:
    """'onednn (211 linear layers, 60 groups, 30 decoder layers in one function, 30 with RMSNorm and
    rotary in C (torch's bits))' where `use` switched the model's layers, else None."""
    return getattr(model, "lmtrace_matmul", None)


def _eligible(module: torch.nn.Linear) -> bool:
    w = module.weight
    return w.dtype == torch.float32 and w.device.type == "cpu" and torch.backends.mkldnn.is_available()


def packed_weight(module: torch.nn.Linear) -> torch.Tensor:
    """The float32 layer's weight in oneDNN's layout (packed again where the weight changed):
    what the batch-invariant products (lmtrace.model.invariant.products) run on."""
    return _packed(module)


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


def _group_packed(group: Group) -> Packed:
    """The group's stacked weight in oneDNN's layout (and bias), packed again where one changed."""
    p = group.packed
    if p is None or p.version != group.weights():
        layers = group.layers
        with torch.inference_mode(False), torch.no_grad():
            stacked = torch.cat([m.weight.detach() for m in layers])  # (sum of out, in)
            weight = torch.ops.mkldnn._reorder_linear_weight(stacked, _LAYOUT_ROWS)
            biases = [m.bias.detach() if m.bias is not None else torch.zeros(m.out_features) for m in layers]
            bias = torch.cat(biases) if any(m.bias is not None for m in layers) else None
        group.packed = p = Packed(weight, group.weights(), 0, bias)  # type: ignore[arg-type]
    return p


def _from_group(self: torch.nn.Linear, group: Group, x: torch.Tensor) -> torch.Tensor:
    """This layer's part of its group's product for the input `x` (..., in): computed for all the
    group's layers at the first call with this very tensor, taken from there by the others."""
    k = group.layers.index(self)
    stash = group.stash
    if stash is None or stash[0] is not x or stash[1] != _version(x) or stash[2][k] is None:
        p = _group_packed(group)
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (..., in) -> (rows, in)
        y = torch.ops.mkldnn._linear_pointwise(rows, p.weight, p.bias, "none", [], "")  # (rows, sum of out)
        parts: list[torch.Tensor | None] = list(y.split([m.out_features for m in group.layers], dim=-1))
        stash = group.stash = (x, _version(x), parts)
    part, stash[2][k] = stash[2][k], None  # each part handed out once
    if all(t is None for t in stash[2]):
        group.stash = None
    return part.contiguous().reshape(*x.shape[:-1], self.out_features)  # type: ignore[union-attr]


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place edit counter; an inference tensor keeps none (-1: its identity decides)."""
    return -1 if t.is_inference() else t._version


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.requires_grad or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)  # autograd (attribution's gradients) or another dtype
    group = getattr(self, "_lmtrace_group", None)
    if group is not None:
        return _from_group(self, group, x)
    rows = x.reshape(-1, x.shape[-1])  # (..., in) -> (rows, in)
    y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), _packed(self), self.bias, "none", [], "")
    return y.reshape(*x.shape[:-1], y.shape[-1])  # (rows, out) -> (..., out)
