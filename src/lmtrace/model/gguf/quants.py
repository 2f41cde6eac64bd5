"""The GGUF block types read as integers: every supported type's weight is, per sub-block of 16
or 32 weights along the input, w = s * q + o with q a small integer, s a float32 scale and o an
optional float32 offset, each computed from the block's fields exactly as the gguf package's own
`dequantize` computes them (so s * q + o, rounded once to float32, is gguf's float32 value):

    type     block  sub  q range        s                 o
    Q4_0       32   32   [-8, 7]        d                 -
    Q4_1       32   32   [0, 15]        d                 m
    Q5_0       32   32   [-16, 15]      d                 -
    Q5_1       32   32   [0, 31]        d                 m
    Q8_0       32   32   [-128, 127]    d                 -
    IQ4_NL     32   32   [-127, 113]    d                 -   (q from the 16-entry kvalues table)
    Q4_K      256   32   [0, 15]        d * sc            -dmin * m
    Q5_K      256   32   [0, 31]        d * sc            -dmin * m
    Q6_K      256   16   [-32, 31]      d * sc            -
    IQ4_XS    256   32   [-127, 113]    d * (ls - 32)     -

The layouts follow gguf/quants.py (which follows ggml-quants.c); tests/test_packed_types.py checks
each against `gguf.quants.dequantize`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
KVALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.int16)


@dataclass
class Decoded:
    """One tensor as integers: q (out, in) int16, scale and offset (out, in / sub) float32."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    sub: int  # weights per scale along the input: 16 or 32
    low: int  # the smallest q the type can hold (the codes are q - low)
    span: int  # how many q values the type can hold


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) bytes -> (n, 1) float32 of the float16 they hold."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """(n, k * width / 2) bytes -> (n, k * width) values: each run of width / 2 bytes gives its
    low nibbles, then its high nibbles (ggml's order)."""
    n = qs.shape[0]
    v = qs.reshape(n, -1, 1, width // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (v & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1: (n, 4) bytes, one bit per weight -> (n, 32) values in {0, 1}."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32).reshape(1, count)
    return (bits & 1).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (gguf's Q4_K.get_scale_min)."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc.astype(np.float32), mn.astype(np.float32)


def _small(type_name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q (n, 32), s (n, 1), o (n, 1) or None) of n blocks of a 32-weight type."""
    d = _f16(b[:, :2])
    if type_name == "Q8_0":
        return b[:, 2:].copy().view(np.int8).astype(np.int16), d, None
    if type_name == "Q4_0":
        return _nibbles(b[:, 2:], 32).astype(np.int16) - 8, d, None
    if type_name == "IQ4_NL":
        return KVALUES[_nibbles(b[:, 2:], 32)], d, None
    if type_name == "Q4_1":
        return _nibbles(b[:, 4:], 32).astype(np.int16), d, _f16(b[:, 2:4])
    if type_name == "Q5_0":
        q = _nibbles(b[:, 6:], 32) | (_high_bits(b[:, 2:6], 32) << 4)
        return q.astype(np.int16) - 16, d, None
    q = _nibbles(b[:, 8:], 32) | (_high_bits(b[:, 4:8], 32) << 4)  # Q5_1
    return q.astype(np.int16), d, _f16(b[:, 2:4])


def _k(type_name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q (n, 256), s (n, subs), o (n, subs) or None) of n blocks of a 256-weight type."""
    n = b.shape[0]
    if type_name == "Q6_K":
        ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        low = _nibbles(ql, 128).reshape(n, -1, 32)  # (n, 8, 32)
        high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        high = (high & 0x03).reshape(n, -1, 32)
        q = (low | (high << 4)).astype(np.int16).reshape(n, QK_K) - 32
        return q, d * scales.copy().view(np.int8).astype(np.float32), None
    if type_name == "IQ4_XS":
        d, scales_h, scales_l, qs = _f16(b[:, :2]), b[:, 2:4].copy().view(np.uint16), b[:, 4:8], b[:, 8:]
        sl = (scales_l.reshape(n, -1, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, -1) & 0x0F
        sh = scales_h.reshape(n, 1, -1) >> np.array([2 * i for i in range(8)], dtype=np.uint16).reshape(1, -1, 1)
        sh = sh.reshape(n, -1).astype(np.uint8) & 0x03
        ls = (sl | (sh << 4)).astype(np.int16) - 32
        return KVALUES[_nibbles(qs, 32)], d * ls.astype(np.float32), None
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    if type_name == "Q4_K":
        q = _nibbles(b[:, 16:], 64)
    else:  # Q5_K: 32 bytes of fifth bits, bit j of byte i for weight i of sub-block j
        high = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _nibbles(b[:, 48:], 64) | ((high & 1).reshape(n, QK_K) << 4)
    return q.astype(np.int16), d * sc, -(dmin * mn)


# type -> (weights a block, bytes a block, weights a scale, smallest q, how many q values)
TYPES = {
    "Q4_0": (32, 18, 32, -8, 16),
    "Q4_1": (32, 20, 32, 0, 16),
    "Q5_0": (32, 22, 32, -16, 32),
    "Q5_1": (32, 24, 32, 0, 32),
    "Q8_0": (32, 34, 32, -128, 256),
    "IQ4_NL": (32, 18, 32, -127, 241),
    "Q4_K": (256, 144, 32, 0, 16),
    "Q5_K": (256, 176, 32, 0, 32),
    "Q6_K": (256, 210, 16, -32, 64),
    "IQ4_XS": (256, 136, 32, -127, 241),
}


def decode(type_name: str, raw: np.ndarray, out_features: int, in_features: int) -> Decoded:
    """The integers, scales and offsets of one tensor's raw blocks (one row per output feature)."""
    if type_name not in TYPES:
        raise ValueError(f"no packed form for {type_name} (packed types: {', '.join(TYPES)})")
    block, nbytes, sub, low, span = TYPES[type_name]
    if in_features % block:
        raise ValueError(f"input size {in_features} is not a multiple of {type_name}'s block of {block}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)  # (out * in / block, bytes)
    q, s, o = (_small if block == 32 else _k)(type_name, blocks)
    rows = (out_features, -1)
    return Decoded(q.reshape(rows), s.reshape(rows), None if o is None else o.reshape(rows), sub, low, span)
