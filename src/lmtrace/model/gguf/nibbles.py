"""The form lmtrace's own C kernel reads a packed GGUF layer in (lmtrace/model/fused/int4.c), made
from the same Int4Form pieces as torch's int4 kernel's (model/gguf/blocks.py): output columns in
panels of 64 (the last padded with weights 0); per panel, run of 8 input positions (the pieces side
by side) and block of 8 columns, one 32-bit word per column whose nibble j holds c ^ 8 for position
j (a signed nibble equal to c - 8: two shifts unpack it, no lookup or sign fix); per panel and
group of 32 positions, the 64 columns' float32 scales S and zeros Z, the weight being
(c - 8) * S + Z. The kernel makes each weight with one rounding, so a one-piece type's are gguf's
own dequantized values, and multiplies float32 inputs without rounding them (torch's int4 kernel
rounds every input, scale and zero to bfloat16). A two-piece form (5 to 8 bits), and Q6_K's four,
are held as one piece of 8-bit codes instead (`bytes_form`): (panels, in, 64) int8, the weight
c * S + Z, a scale per 32 positions (per 16 for Q6_K)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.model.gguf.blocks import GROUP, Int4Form

PANEL = 64  # output columns the kernel makes together (int4.c's PANEL)


def kernel_available() -> bool:
    """Whether the C kernel can run here: a C compiler builds it (once, into lmtrace's cache)."""
    from lmtrace.model.fused.build import library

    try:
        library()
    except InvalidParameter:
        return False
    return True


def nibbles(form: Int4Form) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (panels, positions * 8) int32 words, scales and zeros (2, panels, groups * 64)
    float32) of one form: positions = pieces * in, groups = positions / 32."""
    out, positions = form.codes.shape
    extra = -out % PANEL
    codes = form.codes.to(torch.int64) ^ 8
    scales_zeros = torch.stack([form.scales, form.zeros])  # (2, groups, out)
    if extra:  # code 8 (stored 0), scale 0, zero 0: weight 0
        codes = torch.cat([codes, codes.new_zeros((extra, positions))])
        scales_zeros = torch.cat([scales_zeros, scales_zeros.new_zeros((2, scales_zeros.shape[1], extra))], 2)
    panels = (out + extra) // PANEL
    # (panels, 8 blocks, 8 columns, runs, 8 positions) -> (panels, runs, blocks, columns, positions)
    runs = codes.reshape(panels, 8, 8, positions // 8, 8).permute(0, 3, 1, 2, 4)
    words = (runs << (4 * torch.arange(8))).sum(-1)  # nibble j: position j
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).reshape(panels, -1)
    groups = positions // GROUP
    scales_zeros = scales_zeros.reshape(2, groups, panels, PANEL).transpose(1, 2).reshape(2, panels, -1)
    return words.contiguous(), scales_zeros.contiguous()


def bytes_form(form: Int4Form) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The form as one piece of 8-bit codes where it is two 4-bit pieces (a type of 5 to 8 bits) or
    Q6_K's four (`_pair`, `_sixteen`): c * S + Z is then the pieces' exact sum, in one rounding
    (gguf's own value); (codes (panels, in * 64) int8, scales and zeros (2, panels, groups * 64)
    float32, the positions a scale covers: 32, or 16 for Q6_K), or None where the form is neither
    or a zero would not be a float32 number."""
    made = _pair(form) if form.pieces == 2 else _sixteen(form) if form.pieces == 4 else None
    if made is None:
        return None
    codes, scales, zeros, group = made
    return *_bytes_layout(codes, torch.stack([scales, zeros])), group


def _pair(form: Int4Form) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """High and low nibbles, S_high = 16 S_low: c = 16 (c_high - 8) + c_low in [-128, 127], S = S_low,
    Z = Z_high + Z_low - 8 S_low."""
    n, groups = form.in_features, form.in_features // GROUP
    s_high, s_low = form.scales[:groups].double(), form.scales[groups:].double()
    if not torch.equal(s_high, 16 * s_low):
        return None
    zeros = form.zeros[:groups].double() + form.zeros[groups:].double() - 8 * s_low
    if not torch.equal(zeros.float().double(), zeros):
        return None
    codes = 16 * (form.codes[:, :n] - 8) + form.codes[:, n:]  # (out, in)
    return codes, s_low.float(), zeros.float(), GROUP


def _sixteen(form: Int4Form) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """Q6_K's four pieces (blocks.py: high and low nibble of each half of a group of 32, code 8 on
    the other half, every Z = 0): c = 16 h + l, one scale per 16 positions, Z = 0."""
    n, groups = form.in_features, form.in_features // GROUP
    parts = [form.codes[:, p * n : (p + 1) * n] - 8 for p in range(4)]  # high0, low0, high1, low1
    scales = [form.scales[p * groups : (p + 1) * groups] for p in range(4)]
    first = torch.zeros(GROUP, dtype=torch.bool)
    first[:16] = True
    first = first.repeat(groups)  # positions in the first half of their group
    quiet = [~first, ~first, first, first]  # where each piece must hold code 8 (0)
    if not all(torch.equal(s, torch.zeros_like(s)) for s in (p[:, q] for p, q in zip(parts, quiet))):
        return None
    if not (torch.equal(scales[0], 16 * scales[1]) and torch.equal(scales[2], 16 * scales[3])):
        return None
    if form.zeros.abs().max() != 0:
        return None
    codes = 16 * (parts[0] + parts[2]) + parts[1] + parts[3]
    if codes.min() < -128 or codes.max() > 127:
        return None
    per_16 = torch.stack([scales[1], scales[3]], 1).reshape(2 * groups, -1)  # (in / 16, out)
    return codes, per_16, torch.zeros_like(per_16), 16


def _bytes_layout(codes: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (out, in) in [-128, 127] and scales_zeros (2, groups, out) in the kernel's 8-bit form:
    (panels, in * 64) int8 (each panel's 64 codes a position side by side), (2, panels, groups * 64)."""
    out, n = codes.shape
    groups = scales_zeros.shape[1]
    extra = -out % PANEL
    if extra:  # code 0, scale 0, zero 0: weight 0
        codes = torch.cat([codes, codes.new_zeros((extra, n))])
        scales_zeros = torch.cat([scales_zeros, scales_zeros.new_zeros((2, groups, extra))], 2)
    panels = (out + extra) // PANEL
    codes = codes.to(torch.int8).reshape(panels, PANEL, n).transpose(1, 2).reshape(panels, -1)  # (panels, in, 64)
    scales_zeros = scales_zeros.reshape(2, groups, panels, PANEL).transpose(1, 2).reshape(2, panels, -1)
    return codes.contiguous(), scales_zeros.contiguous()


def nibble_chunks(forms: Iterable[Int4Form], pieces: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The C form of `rows` rows given in chunks (each a multiple of 64 rows but the last), copied
    into buffers made once, its bits and the positions a scale covers: 8 bits where the chunks are
    forms `bytes_form` takes (each chunk must, or a ValueError about row chunks), else 4 (and 32)."""
    codes = scales_zeros = None
    done, panels, bits, group = 0, -(-rows // PANEL), 4, GROUP
    for part in forms:
        if part.pieces != pieces:
            raise ValueError("row chunks of different pieces")
        if done % PANEL:
            raise ValueError(f"a row chunk after {done} rows: chunks but the last must be a multiple of 64 rows")
        as_bytes = bytes_form(part) if bits == 8 or codes is None else None
        if codes is None and as_bytes is not None:
            bits = 8
        elif bits == 8 and as_bytes is None:
            raise ValueError("row chunks of which only some have an 8-bit form")
        if as_bytes is not None:
            c, sz, group = as_bytes
        else:
            c, sz = nibbles(part)
        if codes is None or scales_zeros is None:
            codes = c.new_empty((panels, c.shape[1]))
            scales_zeros = sz.new_empty((2, panels, sz.shape[2]))
        at = done // PANEL
        if at + len(c) > panels:
            raise ValueError(f"row chunks of more than the layer's {rows} rows")
        codes[at : at + len(c)] = c
        scales_zeros[:, at : at + len(c)] = sz
        done += part.codes.shape[0]
    if done != rows or codes is None or scales_zeros is None:
        raise ValueError(f"row chunks of {done} rows for a layer of {rows}")
    return codes, scales_zeros, bits, group
