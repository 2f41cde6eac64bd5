"""GGUF quantized tensors rewritten, without rounding, in the form torch's CPU int4 weight-only
kernel reads (`aten._weight_int4pack_mm_for_cpu`): 4-bit codes c in [0, 15] and, per group of 32
along the input, a scale S and a zero Z, the weight being (c - 8) * S + Z. A type whose integers
need more than 4 bits is held as `pieces` such forms side by side along the input (the input is
fed that many times), their weights adding up to the tensor's (model/gguf/quants.py gives each
type as w = s * q + o per sub-block):

- 1 piece (Q4_0, Q4_1, Q4_K: 16 values of q): c = q - low, S = s, Z = s * (low + 8) + o.
- 2 pieces (Q5_0, Q5_1, Q5_K, Q8_0, IQ4_NL, IQ4_XS: up to 256 values): q - low = 16 h + l, the
  high piece c = h, S = 16 s; the low piece c = l, S = s; the zeros carry s * low + o.
- 4 pieces (Q6_K, whose scale changes every 16 weights, a group of 32 holding two sub-blocks):
  q = 16 h + l with h, l in [-8, 7]; a high and a low piece for the group's first sub-block
  (code 8, weight 0, on the second one's positions), then the same for the second; every Z = 0.

Every stored S and Z is a float32 number that holds its value exactly (checked: a tensor whose
zeros would round gets one more piece, all code 8, carrying the offset alone), so the sum of the
pieces, in exact arithmetic, is s * q + o, and rounded once to float32 it is gguf's own value."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmtrace.model.gguf.quants import TYPES, Decoded, decode

GROUP = 32  # the kernel's group along the input dimension
SUPPORTED = tuple(TYPES)


@dataclass
class Int4Form:
    codes: torch.Tensor  # (out, pieces * in) int32 in [0, 15]
    scales: torch.Tensor  # (pieces * in / 32, out) float32
    zeros: torch.Tensor  # (pieces * in / 32, out) float32
    pieces: int  # how many times the input is fed (the pieces' inputs side by side)

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // self.pieces

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32: what the kernel multiplies by, summed in float64 (exact here) and
        rounded once."""
        out = self.codes.shape[0]
        w = self.codes.reshape(out, -1, GROUP).double().sub_(8)  # (out, groups, 32)
        w = w.mul_(self.scales.t().double()[:, :, None]).add_(self.zeros.t().double()[:, :, None]).reshape(out, -1)
        return w.reshape(out, self.pieces, self.in_features).sum(dim=1).float()


def _exact(x: np.ndarray) -> np.ndarray:
    """Where the float64 values `x` are float32 numbers."""
    return x.astype(np.float32).astype(np.float64) == x


def _groups(a: np.ndarray) -> np.ndarray:
    """(out, in) -> (out, in / 32, 32)."""
    return a.reshape(a.shape[0], -1, GROUP)


def _wide(dec: Decoded) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Pieces (codes (out, in), S (out, groups), Z (out, groups)) of a sub-block-32 type."""
    s = dec.scale.astype(np.float64)
    o = np.zeros_like(s) if dec.offset is None else dec.offset.astype(np.float64)
    base = s * dec.low + o  # what the codes' offset contributes
    v = (dec.q - dec.low).astype(np.int32)  # in [0, span)
    if dec.span <= 16:
        zero = base + 8 * s
        if _exact(zero).all():
            return [(v, s, zero)]
        return [(v, s, 8 * s), (np.full_like(v, 8), s, base)]  # the offset alone, code 8 everywhere
    high, low = v >> 4, v & 0x0F
    z_low = 8 * s + base
    z_high = np.where(_exact(z_low), 128 * s, 128 * s + base)
    z_low = np.where(_exact(z_low), z_low, 8 * s)
    pieces = [(high, 16 * s, z_high), (low, s, z_low)]
    if not _exact(z_high).all():  # the offset in neither: a third piece carries it
        pieces = [(high, 16 * s, 128 * s), (low, s, 8 * s), (np.full_like(v, 8), s, base)]
    return pieces


def _sixteen(dec: Decoded) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Four pieces of a sub-block-16 type without offsets (Q6_K)."""
    if dec.offset is not None:
        raise ValueError("no packed form for offsets on sub-blocks of 16")
    q = dec.q.astype(np.int32)
    high = (q + 8) >> 4  # q = 16 high + low, low in [-8, 7]
    low = q - 16 * high
    if high.min(initial=0) < -8 or high.max(initial=0) > 7:
        raise ValueError("integers out of the 4-bit pieces' range")
    s = dec.scale.astype(np.float64)  # (out, in / 16)
    pieces = []
    for half in (0, 1):  # the first, then the second sub-block of each group of 32
        mask = np.zeros(GROUP, dtype=bool)
        mask[16 * half : 16 * half + 16] = True
        keep = np.broadcast_to(mask, _groups(q).shape).reshape(q.shape)
        for part, factor in ((high, 16), (low, 1)):
            pieces.append((np.where(keep, part + 8, 8), factor * s[:, half::2], np.zeros_like(s[:, half::2])))
    return pieces


def int4_form(type_name: str, raw: np.ndarray, out_features: int, in_features: int) -> Int4Form:
    """The blocks of one tensor (raw bytes, one row per output feature) in the kernel's form."""
    dec = decode(type_name, raw, out_features, in_features)
    if in_features % GROUP:
        raise ValueError(f"input size {in_features} is not a multiple of {GROUP}")
    pieces = _sixteen(dec) if dec.sub == 16 else _wide(dec)
    for _, scale, zero in pieces:
        if not (_exact(scale).all() and _exact(zero).all()):
            raise ValueError("a scale or zero is not a float32 number")
    codes = np.concatenate([c for c, _, _ in pieces], axis=1)  # (out, pieces * in)
    scales = np.concatenate([np.broadcast_to(s, _groups(c).shape[:2]) for c, s, _ in pieces], axis=1)
    zeros = np.concatenate([np.broadcast_to(z, _groups(c).shape[:2]) for c, _, z in pieces], axis=1)
    return Int4Form(
        codes=torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int32)),
        scales=torch.from_numpy(np.ascontiguousarray(scales.T, dtype=np.float32)),  # (out, groups) -> (groups, out)
        zeros=torch.from_numpy(np.ascontiguousarray(zeros.T, dtype=np.float32)),
        pieces=len(pieces),
    )


def permute_rows(form: Int4Form, order: torch.Tensor) -> Int4Form:
    """The same tensor with its output rows reordered (transformers un-permutes Llama's q/k)."""
    return Int4Form(
        form.codes[order].contiguous(),
        form.scales[:, order].contiguous(),
        form.zeros[:, order].contiguous(),
        form.pieces,
    )
