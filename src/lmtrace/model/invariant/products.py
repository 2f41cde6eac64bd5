"""The linear layers' products, the same bits for a row whatever rows are beside it.

torch's default kernel (MKL's sgemm) sums a row's products in another order at 1 row than at 8
(3.4e-5 apart on the bundled model's logprobs). oneDNN with the weight packed once
(lmtrace.model.matmul) gives every row the same bits at any row count from 2 up, at any slot
(measured with 1 and 2 threads, 2 to 512 rows, on the bundled model's five weight shapes); a
single row takes another path for some shapes (the 1536-wide down projection moved 2.6e-6).
So a lone row is computed twice, as a pair (at one row the packed kernel costs about one row),
except for the shapes where the lone row's bits are measured equal to the pair's (`lone_row_alike`,
once per shape and thread count).

Gradients: the backward is the plain linear layer's (grad @ W, gradᵀ @ x), so a trainer's
loss.backward() works through the invariant forward."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.model import matmul

# rows below this are computed as this many (the lone row duplicated): oneDNN's one-row path differs
MIN_ROWS = 2


# (in, out, bias, threads) -> whether oneDNN gives a lone row the bits it gives that row among others
_LONE: dict[tuple[int, int, bool, int], bool] = {}
# the row counts a lone row is held to (the pair, and counts on either side of the kernels' blocks)
_CHECKED_ROWS = (2, 3, 8)


def _product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")


def lone_row_alike(packed: torch.Tensor, bias: torch.Tensor | None, width: int) -> bool:
    """Whether a lone row's product has the bits of the same row among 2, 3 and 8 rows for this
    weight's shape and thread count: measured once per shape on random rows (the kernel's path,
    and so its order of summation, depends on the shape, not on the values)."""
    key = (width, packed.shape[0], bias is not None, torch.get_num_threads())  # packed: (out, in)
    if key not in _LONE:
        with torch.inference_mode(False), torch.no_grad():
            x = torch.randn(max(_CHECKED_ROWS), width, generator=torch.Generator().manual_seed(0))
            one = _product(x[:1], packed, bias)[0]
            _LONE[key] = all(torch.equal(one, _product(x[:k], packed, bias)[0]) for k in _CHECKED_ROWS)
    return _LONE[key]


def packed_product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`rows` (n, in) times the packed weight: (n, out), each row's bits independent of the others."""
    n = rows.shape[0]
    if n == 1 and lone_row_alike(packed, bias, rows.shape[1]):
        return _product(rows, packed, bias)
    if n < MIN_ROWS:  # (n, in) -> (MIN_ROWS, in): the lone row repeated
        rows = rows.expand(MIN_ROWS, rows.shape[1]) if n == 1 else torch.zeros(MIN_ROWS, rows.shape[1])
    return _product(rows, packed, bias)[:n]


class Product(torch.autograd.Function):
    """The invariant product forward, the plain linear layer's gradient backward."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, bias: Any, packed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.with_bias = bias is not None
        return packed_product(rows, packed, None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None  # (n, out) @ (out, in)
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None  # (out, n) @ (n, in)
        grad_bias = grad.sum(0) if ctx.with_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias, None


def invariant_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's forward on the invariant product: `x` (..., in) -> (..., out)."""
    rows = x.reshape(-1, x.shape[-1])  # (..., in) -> (rows, in)
    packed = matmul.packed_weight(self)
    if torch.is_grad_enabled() and (rows.requires_grad or self.weight.requires_grad):
        y = Product.apply(rows, self.weight, self.bias, packed)
    else:  # no gradient asked for: the product alone (autograd's Function costs ~0.1 ms a call)
        y = packed_product(rows, packed, None if self.bias is None else self.bias.detach())
    return y.reshape(*x.shape[:-1], y.shape[-1])  # (rows, out) -> (..., out)


def eligible(module: torch.nn.Linear) -> bool:
    """Whether the invariant product can run this layer: float32 on a CPU with oneDNN."""
    w = module.weight
    return w.dtype == torch.float32 and w.device.type == "cpu" and torch.backends.mkldnn.is_available()
