"""A Llama decoder layer computed as one function over its products: oneDNN's packed float32
weights (`matmul="onednn"`) or a GGUF's 4-bit blocks (`weights="packed"`).

transformers' LlamaDecoderLayer reaches its arithmetic through nine modules (two RMSNorms, the
attention with q/k/v/o, the MLP with gate/up/down), each call through `nn.Module`'s dispatch, the
grouped products handed out part by part (copied to be contiguous), RMSNorm in five tensor ops and
the rotary embedding applied to q and to k apart. At a decode step of a small model those costs are
a large part of the step (the bundled model, 8 rows: about 17 of a 55 ms forward outside the
products; 13 with this function; on a GGUF's 4-bit blocks, one row, 64 tokens: 65.6 tok/s against
60.5 through transformers' layers, 8 rows 238.5 against 234.6).

`install` gives each such layer `forward` below: the same operations on the same numbers, in the
same order, with less around them. RMSNorm is torch's own `rms_norm` (the module's arithmetic in one
op), q/k/v and gate/up each one packed product whose parts are read in place (4-bit: q/k/v read one
converted input, gate/up are the fused MLP's one product), the rotary embedding
applied to q and k in one pass (the same products, see `_rotated`), the attention through transformers'
own attention interface (so attention capture and the KV-cache lab still see it), the cache updated
as the attention module would. A layer is switched only where its output equals transformers'
forward bit for bit on a probe input; `tests/test_layer_path.py` checks whole decodes.

A call falls back to transformers' forward wherever something watches or changes a part of the
layer: a hook on any of its modules (or a global module hook), a module whose forward was replaced,
a group no longer formed, gradients on (attribution), training mode, an input that is not float32,
or torch.compile tracing the model (it traces transformers' forward, as before).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from lmtrace.errors import InvalidParameter
from lmtrace.model import matmul
from lmtrace.model.fused import ops as fused_ops
from lmtrace.model.gguf.joined import joined_of
from lmtrace.model.layer_c import C_FORM, activation, c_form, make_c_form

# the only decoder layers switched: these classes exactly (others pass more to the attention,
# such as a sliding window, or have norms of their own); the MLP transformers' or the packed fused one
_CLASSES = {"LlamaDecoderLayer": ("LlamaAttention", ("LlamaMLP", "FusedMLP"), "LlamaRMSNorm")}


def install(model: Any, fused: bool = False) -> int:
    """Switches every Llama decoder layer whose products are oneDNN's grouped ones or packed 4-bit
    ones and whose output equals transformers' forward bit for bit on a probe; returns how many.
    Where a C compiler is at hand, the switched layers' RMSNorm, residual add and rotary embedding
    run in C with torch's bits (lmtrace.model.fused; each layer's probe still equal bit for bit).
    `fused`: all the small operations in C, each layer checked on the probe to stay within
    float32 rounding of the exact function (matmul "onednn-fused"), as packed layers on lmtrace's
    int4 kernel always are (`_own_int4`)."""
    remove(model)
    rotary = _rotary(model)
    switched = 0
    for layer in model.modules():
        if rotary is None or not _shaped(layer) or not _fits(layer):
            continue
        layer.forward = types.MethodType(forward, layer)
        if _same_on_probe(layer, rotary):
            switched += 1
        else:
            del layer.forward
    if switched:
        try:
            fuse(model, True, exact=not fused)
        except InvalidParameter:  # no C compiler: torch's operations, the same bits (onednn-fused: refused)
            if fused:
                raise
    return switched


def fuse(model: Any, on: bool, exact: bool = False) -> int:
    """Switched layers compute their small operations in C (lmtrace.model.fused) or not (`on`
    False: the exact function again); a layer is fused only where, on the probe, its output stays
    within float32 rounding of transformers' layer. `exact`: only the kernels with torch's bits
    (RMSNorm, the residual add, the rotary embedding), and only where the probe's output equals
    transformers' layer bit for bit; packed layers on lmtrace's int4 kernel take all the kernels
    whatever `exact` (`_own_int4`). Returns how many are fused."""
    rotary = _rotary(model)
    for layer in model.modules():
        if switched(layer):
            layer.__dict__.pop("_lmtrace_fused", None)
            layer.__dict__.pop(C_FORM, None)
            if on:
                _fuse(layer, rotary, exact and not _own_int4(layer))
    return fused_layers(model)


def fused_layers(model: Any, every: bool = False) -> int:
    """How many switched layers compute their small operations in C (`every`: all of them, SiLU·mul
    and the decode step's attention too)."""
    wanted = (ALL,) if every else (EXACT, ALL)
    return sum(1 for layer in model.modules() if switched(layer) and layer.__dict__.get("_lmtrace_fused") in wanted)


def _own_int4(layer: Any) -> bool:
    """The layer's products run on lmtrace's int4 kernel (packed weights, float32 inputs): its numbers
    are already lmtrace's, not transformers', so all its small operations run in C too (each layer
    still checked on the probe to stay within float32 rounding of the exact function)."""
    return bool(getattr(layer._modules["self_attn"].q_proj, "own_kernel", False))


def remove(model: Any) -> None:
    """Puts transformers' forward back on every switched layer."""
    for layer in model.modules():
        if switched(layer):
            del layer.forward
        layer.__dict__.pop("_lmtrace_fused", None)
        layer.__dict__.pop(C_FORM, None)


def switched(layer: Any) -> bool:
    return "forward" in vars(layer) and getattr(layer.forward, "__func__", None) is forward


def forward(
    self: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """LlamaDecoderLayer.forward's arithmetic, bit for bit (see the module's docstring)."""
    if not _plain(self, hidden_states, position_embeddings, kwargs):
        return type(self).forward(
            self,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    attn, mlp = self.self_attn, self.mlp
    b, s, d = hidden_states.shape
    heads, kv = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    products = ONEDNN if type(attn.q_proj) is torch.nn.Linear else PACKED
    kernels = self.__dict__.get("_lmtrace_fused")  # None, EXACT or ALL
    fused, every = kernels is not None, kernels == ALL
    in_c = c_form(self) if every else None  # on lmtrace's kernel: the same operations in two C calls
    if in_c is not None:
        qkv, qk = in_c.qkv(hidden_states, *position_embeddings)  # type: ignore[misc]
        qkv = qkv.view(b, s, heads + 2 * kv, attn.head_dim)
    else:
        x = _norm(self.input_layernorm, hidden_states, fused)
        qkv = products.qkv(attn, x).view(b, s, heads + 2 * kv, attn.head_dim)
        part, emb = qkv[:, :, : heads + kv], position_embeddings
        qk = fused_ops.rotary(part, *emb) if fused else _rotated(part, emb)  # type: ignore[arg-type,misc]
    q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)  # (b, heads, s, head_dim)
    v = qkv[:, :, heads + kv :].transpose(1, 2)
    passed = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what LlamaAttention passes on
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=passed)
    if in_c is not None and _fused_attention(attn, q, k, attention_mask, kwargs):
        return in_c.rest(hidden_states, q, k, v, attention_mask)
    if every and _fused_attention(attn, q, k, attention_mask, kwargs):
        out = fused_ops.decode_attention(q, k, v, attention_mask, attn.scaling)
    else:
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        out, _ = attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **passed)
    attended = products.linear(attn.o_proj, out.reshape(b, s, -1).contiguous())
    h, x = _add_norm(self.post_attention_layernorm, hidden_states, attended, fused)
    gate_up, inter = products.gate_up(mlp, x)  # (rows, 2 * intermediate), intermediate
    return h + products.linear(mlp.down_proj, _activated(mlp, gate_up, inter, every)).view(b, s, d)


class _OneDNN:
    """The products on oneDNN's packed float32 weights (lmtrace.model.matmul's groups)."""

    @staticmethod
    def qkv(attn: Any, x: torch.Tensor) -> torch.Tensor:
        return matmul.together([attn.q_proj, attn.k_proj, attn.v_proj], x)

    @staticmethod
    def linear(layer: Any, x: torch.Tensor) -> torch.Tensor:
        return matmul.linear(layer, x)

    @staticmethod
    def gate_up(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return matmul.together([mlp.gate_proj, mlp.up_proj], x), mlp.gate_proj.out_features

    @staticmethod
    def fits(layer: Any) -> bool:
        attn, mlp = layer.self_attn, layer.mlp
        return (
            matmul.grouped([attn.q_proj, attn.k_proj, attn.v_proj])
            and matmul.grouped([mlp.gate_proj, mlp.up_proj])
            and matmul.switched(attn.o_proj)
            and matmul.switched(mlp.down_proj)
        )

    @staticmethod
    def intact(layer: Any) -> bool:
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        return attn.q_proj._lmtrace_group is not None and mlp.gate_proj._lmtrace_group is not None


class _Packed:
    """The products on a GGUF's 4-bit blocks (lmtrace.model.gguf.packed): q/k/v one call of
    lmtrace's kernel where joined, else each its own call on one converted input; gate/up the
    fused MLP's one product."""

    @staticmethod
    def qkv(attn: Any, x: torch.Tensor) -> torch.Tensor:
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        flat = q.prepared(x)  # the same conversion each of them makes of x
        joined = joined_of(attn)  # on lmtrace's kernel: one call for the three (model/gguf/joined.py)
        if joined is not None:
            return joined.product(flat)
        return torch.cat([q.product(flat, x.dtype), k.product(flat, x.dtype), v.product(flat, x.dtype)], -1)

    @staticmethod
    def linear(layer: Any, x: torch.Tensor) -> torch.Tensor:
        return layer.product(layer.prepared(x), x.dtype).view(*x.shape[:-1], layer.out_features)

    @staticmethod
    def gate_up(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return mlp.gate_up.product(mlp.gate_up.prepared(x), x.dtype), mlp.sizes[0]

    @staticmethod
    def fits(layer: Any) -> bool:
        """Read from the modules' own dicts: checked at every call of every layer (a dozen
        attribute lookups through nn.Module's __getattr__ cost about 10 us a layer)."""
        a, m = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
        parts = (*(a.get(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")), m.get("gate_up"), m.get("down_proj"))
        if not all(type(p).__name__ == "PackedLinear" for p in parts):  # lmtrace.model.gguf.packed's
            return False
        q, k, v = parts[:3]
        same_input = len({(p.in_features, p.pieces, p.compute_dtype) for p in (q, k, v)}) == 1
        return same_input and all(b is None for b in layer._modules["mlp"].biases)

    @staticmethod
    def intact(layer: Any) -> bool:
        return _Packed.fits(layer)


ONEDNN, PACKED = _OneDNN(), _Packed()


def _norm(norm: Any, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    if fused:
        return fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _add_norm(norm: Any, x: torch.Tensor, y: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x + y and its RMSNorm."""
    if fused:
        return fused_ops.add_rms_norm(x, y, norm.weight, norm.variance_epsilon)
    h = x + y
    return h, _norm(norm, h)


def _activated(mlp: Any, gate_up: torch.Tensor, inter: int, fused: bool) -> torch.Tensor:
    """act(gate) * up for the MLP's one product (rows, 2 * intermediate)."""
    act = activation(mlp)
    if fused and act is F.silu:
        return fused_ops.silu_mul(gate_up, inter)
    return act(gate_up[:, :inter]) * gate_up[:, inter:]


def _fused_attention(attn: Any, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> bool:
    """A decode step's attention the C kernel computes: transformers' own sdpa attention (not one
    registered by an observer: attention capture, the KV-cache lab), no bias or soft cap."""
    if attn.config._attn_implementation != "sdpa" or kwargs.get("position_bias") is not None:
        return False
    return kwargs.get("softcap") is None and fused_ops.decodes(q, k, mask)


def _rotated(x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on (b, s, heads, head_dim), x*cos + rotate_half(x)*sin, as
    x*cos + roll(x)*signed_sin: rotate_half(x) is roll(x) with its first half negated, and the sign
    moved onto sin gives the same products exactly. cos and signed sin are made once per forward
    (every layer gets the same position embeddings). Fused: lmtrace.model.fused.ops.rotary, the
    same roundings."""
    global _EMBEDDINGS
    made = _EMBEDDINGS
    if made is None or made[0] is not position_embeddings[0] or made[1] is not position_embeddings[1]:
        cos, sin = position_embeddings
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        made = _EMBEDDINGS = (cos, sin, cos.unsqueeze(2), signed.unsqueeze(2))  # (b, s, 1, head_dim)
    return (x * made[2]) + (x.roll(x.shape[-1] // 2, dims=-1) * made[3])


# the last forward's position embeddings and what _rotated made of them (held, so never a stale id)
_EMBEDDINGS: tuple[torch.Tensor, ...] | None = None
# a fused layer's kernels: those with torch's bits (RMSNorm, the residual add, rotary), or all of them
EXACT, ALL = "exact", "all"


def _children(layer: Any) -> tuple[Any, ...]:
    """The layer's modules and its attention's and MLP's, as they are now."""
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    return (*layer._modules.values(), *attn._modules.values(), *mlp._modules.values())


def _plain(layer: Any, x: torch.Tensor, position_embeddings: Any, kwargs: dict) -> bool:
    """Nothing watches or changes the layer's parts, and the call is one the function computes."""
    if torch.is_grad_enabled() or layer.training or x.dtype != torch.float32 or position_embeddings is None:
        return False
    if torch.compiler.is_compiling():  # a compiled draft traces transformers' forward
        return False
    if kwargs and (kwargs.get("output_attentions") or "past_key_values" in kwargs):
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks or not _shaped(layer):
        return False
    for m in _children(layer):
        if m._forward_hooks or m._forward_pre_hooks:
            return False
        if not matmul.switched(m) if type(m) is torch.nn.Linear else "forward" in m.__dict__:
            return False  # a forward replaced (the linear layers' must be the packed product's)
    products = ONEDNN if type(layer._modules["self_attn"].q_proj) is torch.nn.Linear else PACKED
    return products.intact(layer)


def _shaped(layer: Any) -> bool:
    kinds = _CLASSES.get(type(layer).__name__)
    if kinds is None:
        return False
    parts = layer._modules  # where nn.Module keeps them (getattr through its __getattr__: 5 us a layer)
    attn, mlp = parts.get("self_attn"), parts.get("mlp")
    norms = (parts.get("input_layernorm"), parts.get("post_attention_layernorm"))
    return (
        type(attn).__name__ == kinds[0]
        and type(mlp).__name__ in kinds[1]
        and all(type(n).__name__ == kinds[2] for n in norms)
    )


def _fits(layer: Any) -> bool:
    """The layer's products are oneDNN's grouped ones or a GGUF's packed ones."""
    products = ONEDNN if type(layer.self_attn.q_proj) is torch.nn.Linear else PACKED
    return products.fits(layer)


def _rotary(model: Any) -> Any:
    return next((m for m in model.modules() if type(m).__name__ == "LlamaRotaryEmbedding"), None)


def _probe(layer: Any, rotary: Any) -> tuple[torch.Tensor, Any]:
    """The layer's output (the switched forward) on a probe of 5 positions (causal), and transformers'."""
    d = layer.self_attn.q_proj.in_features
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5).unsqueeze(0).expand(2, 5)
    with torch.inference_mode():
        emb = rotary(x, position_ids=positions)
        ours = layer(x, position_ids=positions, position_embeddings=emb)
        theirs = type(layer).forward(layer, x, position_ids=positions, position_embeddings=emb)
    return ours, theirs[0] if isinstance(theirs, tuple) else theirs


def _same_on_probe(layer: Any, rotary: Any) -> bool:
    """The switched forward and transformers' on the probe: equal bit for bit."""
    ours, theirs = _probe(layer, rotary)
    return isinstance(theirs, torch.Tensor) and torch.equal(ours, theirs)


def _fuse(layer: Any, rotary: Any, exact: bool) -> None:
    """Fuses the layer's small operations where, on the probe, its output stays within float32
    rounding of transformers' (1e-5 relative: a kernel built wrong shows at once); `exact`: the
    kernels with torch's bits only, where the probe's output is transformers' to the bit. A probe
    that fails (no C compiler) leaves the layer unfused and raises."""
    layer._lmtrace_fused = EXACT if exact else ALL
    if not exact and _own_int4(layer):  # its operations in two C calls where the layer allows (layer.c)
        layer.__dict__[C_FORM] = make_c_form(layer)
    same = False
    try:
        ours, theirs = _probe(layer, rotary)
        scale = float(theirs.abs().max())
        same = torch.equal(ours, theirs) if exact else torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5 * scale)
    finally:
        if not same:
            del layer._lmtrace_fused
            layer.__dict__.pop(C_FORM, None)
