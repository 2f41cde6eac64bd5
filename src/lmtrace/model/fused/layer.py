"""A Llama decoder layer on packed weights in two C calls a decode step (layer.c): the first makes
q/k/v from the layer's input (RMSNorm, one int4 product, the rotary embedding of q and k), the
second, once transformers' cache has taken k and v, the rest (the attention over the cache, the
output product, the residual add and RMSNorm, the MLP, the last residual add). Each operation is the
one lmtrace.model.layer_path calls from Python for such a layer (lmtrace's int4 kernel with every
small operation in C), in the same order on the same numbers: the same output to the bit, without
about forty Python-level calls a layer (about 0.4 ms of a 1 ms layer at one row on a 2-core EPYC)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmtrace.model.fused import ops
from lmtrace.model.fused.build import Int4, Layer, Norm, library


@dataclass(frozen=True)
class Product:
    """A packed product as lmtrace's kernel reads it (lmtrace.model.gguf.nibbles)."""

    codes: torch.Tensor  # (panels, pieces * in * 8) int32
    scale_zeros: torch.Tensor  # (2, panels, groups * 64) float32, each half contiguous
    pieces: int
    in_features: int
    bits: int
    group: int  # input positions a scale covers

    def call(self) -> Int4:
        scales = self.scale_zeros.data_ptr()
        zeros = scales + self.scale_zeros.stride(0) * self.scale_zeros.element_size()
        codes, panels = self.codes.data_ptr(), self.codes.shape[0]
        return Int4(None, 0, self.in_features, codes, scales, zeros, panels, self.pieces, None, self.bits, self.group)


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    scale: float
    eps: tuple[float, float]  # the two RMSNorms'


class CLayer:
    """One decoder layer's two calls. `norms` (input, post-attention) weights; `products` q/k/v (one
    joined product), o, gate/up (one), down; every output a whole number of 64-column panels;
    `watched` the layer's tensors the form stands for (`holds`)."""

    def __init__(
        self,
        norms: tuple[torch.Tensor, torch.Tensor],
        products: list[Product],
        shape: Shape,
        watched: list[torch.Tensor],
    ) -> None:
        self.tensors = [*norms, *(t for p in products for t in (p.codes, p.scale_zeros))]  # what the struct points at
        self.watched = watched  # the layer's tensors as it held them (`holds`)
        self.shape = shape
        call = Layer()
        call.input_norm = Norm(norms[0].data_ptr(), shape.eps[0], ops.LANES)
        call.post_norm = Norm(norms[1].data_ptr(), shape.eps[1], ops.LANES)
        call.qkv, call.o, call.gate_up, call.down = (p.call() for p in products)
        call.hidden, call.heads, call.kv_heads = shape.hidden, shape.heads, shape.kv_heads
        call.head_dim, call.inter, call.scale = shape.head_dim, shape.inter, shape.scale
        call.serial_work = ops.SERIAL_WORK[bool(library().lmt_int4_openmp())]
        self.call, self.width = call, products[0].codes.shape[0] * 64

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copied model's layer has no C form (its calls one by one, the same numbers)

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the layer holds the very tensors it held when this form was made (none replaced:
        the struct reads their memory)."""
        return len(tensors) == len(self.watched) and all(a is b for a, b in zip(tensors, self.watched))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, s, hidden) -> (qkv (b, s, width), qk (b, s, heads + kv_heads, head_dim) rotated)."""
        b, s, _ = x.shape
        sh = self.shape
        x = x.contiguous()
        cos, sin = cos.expand(b, s, sh.head_dim).contiguous(), sin.expand(b, s, sh.head_dim).contiguous()
        qkv = x.new_empty((b, s, self.width))
        qk = x.new_empty((b, s, sh.heads + sh.kv_heads, sh.head_dim))
        self.call.threads = torch.get_num_threads()
        lib = library()
        lib.lmt_layer_qkv(self.call, x.data_ptr(), b * s, cos.data_ptr(), sin.data_ptr(), qkv.data_ptr(), qk.data_ptr())
        return qkv, qk

    def rest(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer's output (b, 1, hidden) for its input x and a decode step's q (b, heads, 1, d) and
        the cache's k, v (b, kv_heads, keys, d), where `ops.decodes(q, k, mask)`."""
        attention, held = ops.attention_call(q, k, v, mask, self.shape.scale)
        x = x.contiguous()
        out = torch.empty_like(x)
        self.call.threads = torch.get_num_threads()
        library().lmt_layer_rest(self.call, attention, x.data_ptr(), x.shape[0] * x.shape[1], out.data_ptr())
        del held
        return out
