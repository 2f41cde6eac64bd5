"""A switched Llama layer's two-call C form (lmtrace.model.fused.layer): made, when lmtrace.model.
layer_path fuses a packed layer on lmtrace's kernel, only where the layer allows it (q/k/v joined,
o, gate/up and down on the kernel too, no bias, a SiLU MLP, every product whole 64-column panels);
used at a call only while the layer still holds the very tensors the form was made of."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lmtrace.model.fused.layer import CLayer, Product, Shape
from lmtrace.model.gguf.joined import joined_of

C_FORM = "_lmtrace_c"  # where a layer keeps its form (in its __dict__: not a submodule)
_SILU = ("SiLUActivation", "SiLU")


def activation(mlp: Any) -> Any:
    """The MLP's activation function: F.silu for transformers' SiLU modules (their forward is it)."""
    act = mlp.act_fn
    return F.silu if type(act).__name__ in _SILU else act


def c_form(layer: Any) -> CLayer | None:
    """The layer's form where it has one and it still reads the layer's own norms and products."""
    form = layer.__dict__.get(C_FORM)
    return form if form is not None and form.holds(held(layer)) else None


def held(layer: Any) -> list[torch.Tensor]:
    """The tensors a packed layer's C form reads, as the layer holds them now: its two norms' weights
    and its six packed layers' buffers (q/k/v: views of their joined pair). Read from the modules'
    own dicts (a few microseconds a layer, where attribute access costs about twenty)."""
    try:
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        a, m = attn._modules, mlp._modules
        parts = (a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"], m["gate_up"], m["down_proj"])
        norms = (layer._modules["input_layernorm"], layer._modules["post_attention_layernorm"])
        buffers = [t for p in parts for t in (p._buffers["packed"], p._buffers["scale_zeros"])]
        return [norms[0]._parameters["weight"], norms[1]._parameters["weight"], *buffers]
    except (KeyError, AttributeError):  # a part replaced by a module of another kind
        return []


def make_c_form(layer: Any) -> CLayer | None:
    """The packed layer's C form, or None where the layer does not allow one."""
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    joined = joined_of(attn)
    parts = [attn._modules["o_proj"], mlp._modules.get("gate_up"), mlp._modules["down_proj"]]
    if joined is None or activation(mlp) is not F.silu or not all(_on_int4(p) for p in parts):
        return None
    hidden, inter = attn.q_proj.in_features, mlp.sizes[0]
    if parts[0].out_features != hidden or parts[2].out_features != hidden or parts[1].out_features != 2 * inter:
        return None
    products = [Product(joined.codes, joined.scale_zeros, joined.pieces, hidden, joined.bits, joined.group)]
    products += [Product(p.packed, p.scale_zeros, p.pieces, p.in_features, p.bits, p.group) for p in parts]
    norms = (layer._modules["input_layernorm"], layer._modules["post_attention_layernorm"])
    heads, kv = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    eps = (float(norms[0].variance_epsilon), float(norms[1].variance_epsilon))
    shape = Shape(hidden, heads, kv, attn.head_dim, inter, float(attn.scaling), eps)
    return CLayer((norms[0].weight, norms[1].weight), products, shape, held(layer))


def _on_int4(layer: Any) -> bool:
    """A packed layer on lmtrace's kernel without a bias, its outputs whole 64-column panels."""
    if not getattr(layer, "own_kernel", False) or layer.bias is not None:
        return False
    return layer.out_features % 64 == 0 and layer.packed.shape[0] * 64 == layer.out_features
