"""GGUF quantized blocks (Q4_0, Q4_1, Q8_0) rewritten, without rounding, in the form torch's
CPU int4 weight-only kernel reads: 4-bit codes c in [0, 15] and, per group of 32 along the
input dimension, a scale s and a zero z, the weight being (c - 8) * s + z
(`aten._weight_int4pack_mm_for_cpu`; see tests/test_packed.py for the check on the kernel).

- Q4_0  w = d * (q - 8)           -> c = q, s = d, z = 0
- Q4_1  w = d * q + m             -> c = q, s = d, z = m + 8 d
- Q8_0  w = d * q, q int8         -> q = 16 hi + lo with hi in [-8, 7], lo in [0, 15]: two
  halves along the input (the input is fed twice): c = hi + 8, s = 16 d, z = 0, then
  c = lo, s = d, z = 8 d.

In float32 every product above is exact (d is a float16 times a small integer), so the
dequantized weight is the same float32 number gguf's own dequantization gives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # every supported type has blocks of 32 weights along the input dimension
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")


@dataclass
class Int4Form:
    codes: torch.Tensor  # (out, in') int32 in [0, 15]; in' = in, or 2 * in for Q8_0
    scales: torch.Tensor  # (in' / 32, out) float32
    zeros: torch.Tensor  # (in' / 32, out) float32
    doubled: bool  # Q8_0: the input is fed twice (the high, then the low nibbles)

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // (2 if self.doubled else 1)

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32: what the kernel multiplies by, in exact arithmetic."""
        w = self.codes.reshape(self.codes.shape[0], -1, GROUP).float().sub_(8)  # (out, groups, 32)
        w = w.mul_(self.scales.t()[:, :, None]).add_(self.zeros.t()[:, :, None]).reshape(self.codes.shape[0], -1)
        if self.doubled:
            high, low = w.split(self.in_features, dim=1)
            return high.add_(low)
        return w


def _split(blocks: np.ndarray, head: int) -> tuple[list[np.ndarray], np.ndarray]:
    """(float16 fields as float32 arrays, the rest) of blocks (rows, n_blocks, block_bytes)."""
    fields = [blocks[..., 2 * i : 2 * i + 2].copy().view(np.float16)[..., 0].astype(np.float32) for i in range(head)]
    return fields, blocks[..., 2 * head :]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(rows, n_blocks, 16) bytes -> (rows, n_blocks * 32) codes: low nibbles are elements
    0..15 of a block, high nibbles 16..31 (ggml's layout)."""
    low, high = qs & 0x0F, qs >> 4
    return np.concatenate([low, high], axis=-1).reshape(qs.shape[0], -1)


def int4_form(type_name: str, raw: np.ndarray, out_features: int, in_features: int) -> Int4Form:
    """The blocks of one tensor (raw bytes, one row per output feature) in the kernel's form."""
    if type_name not in SUPPORTED:
        raise ValueError(f"no exact int4 form for {type_name}")
    if in_features % GROUP:
        raise ValueError(f"input size {in_features} is not a multiple of {GROUP}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, in_features // GROUP, -1)
    if type_name == "Q8_0":
        (d,), qs = _split(blocks, 1)
        q = qs.view(np.int8).astype(np.int16).reshape(out_features, -1)  # (out, in)
        codes = np.concatenate([(q >> 4) + 8, q & 0x0F], axis=1)  # (out, 2 in)
        scales = np.concatenate([16 * d, d], axis=1)  # (out, 2 groups)
        zeros = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
        return _form(codes, scales, zeros, doubled=True)
    if type_name == "Q4_0":
        (d,), qs = _split(blocks, 1)
        return _form(_nibbles(qs), d, np.zeros_like(d), doubled=False)
    (d, m), qs = _split(blocks, 2)  # Q4_1
    return _form(_nibbles(qs), d, m + 8 * d, doubled=False)


def _form(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, doubled: bool) -> Int4Form:
    return Int4Form(
        codes=torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int32)),
        scales=torch.from_numpy(np.ascontiguousarray(scales.T, dtype=np.float32)),  # (out, groups) -> (groups, out)
        zeros=torch.from_numpy(np.ascontiguousarray(zeros.T, dtype=np.float32)),
        doubled=doubled,
    )


def permute_rows(form: Int4Form, order: torch.Tensor) -> Int4Form:
    """The same tensor with its output rows reordered (transformers un-permutes Llama's q/k)."""
    return Int4Form(form.codes[order].contiguous(), form.scales[:, order].contiguous(),
                    form.zeros[:, order].contiguous(), form.doubled)  # fmt: skip
