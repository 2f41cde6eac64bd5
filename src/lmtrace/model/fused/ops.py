"""The fused kernels on torch tensors (float32, CPU): each allocates its output and makes one call
into the C library (lmtrace.model.fused.build). Inputs are made contiguous where they are not."""

from __future__ import annotations

import torch

from lmtrace.model.fused.build import Attention, Int4, Norm, library

# the floats in one of torch's vectors on this CPU: RMSNorm sums its squares in torch's order for it
LANES = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` with `weight`: F.rms_norm's result, to the bit where
    torch's vectors are LANES wide (AVX2, AVX-512), else within float32 rounding."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    library().lmt_rms_norm(x.data_ptr(), out.data_ptr(), x.numel() // n, n, Norm(weight.data_ptr(), eps, LANES))
    return out


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm) with h = x + y exactly as torch adds them and norm = rms_norm(h)."""
    x, y, weight = x.contiguous(), y.contiguous(), weight.contiguous()
    h, out = torch.empty_like(x), torch.empty_like(x)
    n = x.shape[-1]
    norm = Norm(weight.data_ptr(), eps, LANES)
    library().lmt_add_rms_norm(x.data_ptr(), y.data_ptr(), h.data_ptr(), out.data_ptr(), x.numel() // n, n, norm)
    return h, out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate_up[:, :inter]) * gate_up[:, inter:] for `gate_up` (rows, 2 * inter)."""
    gate_up = gate_up.contiguous()
    rows = gate_up.numel() // gate_up.shape[-1]
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    library().lmt_silu_mul(gate_up.data_ptr(), gate_up.shape[-1], out.data_ptr(), rows, inter)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of `x` (b, s, heads, head_dim), read in place where its heads are a
    slice of a wider row (a q/k/v product's): transformers' x * cos + rotate_half(x) * sin to the
    bit, for cos and sin (b, s, head_dim); a new contiguous (b, s, heads, head_dim)."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1] or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    b, s, heads, d = x.shape
    cos, sin = cos.expand(b, s, d).contiguous(), sin.expand(b, s, d).contiguous()
    out = x.new_empty((b, s, heads, d))
    library().lmt_rotary(x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), b * s, heads, d)
    return out


def decodes(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `decode_attention` computes this attention: one query position, float32 on the CPU,
    the key/value heads dividing the query heads, and no mask or a boolean one per row and key
    ((batch or 1, 1, 1, keys), True: attended), the masks transformers' sdpa attention gets."""
    b, heads, s, _ = query.shape
    if s != 1 or query.dtype != torch.float32 or key.dtype != torch.float32 or query.device.type != "cpu":
        return False
    if heads % key.shape[1] or key.shape[0] != b:
        return False
    if mask is None:
        return True
    shaped = mask.dim() == 4 and mask.shape[1:3] == (1, 1) and mask.shape[3] == key.shape[2]
    return mask.dtype == torch.bool and shaped and mask.shape[0] in (1, b)


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(scale q·k) v for one query position (where `decodes`): query (b, heads, 1, d), key and
    value (b, kv_heads, keys, d), read in place whatever their strides along b, heads and keys;
    (b, 1, heads, d) as transformers' attention functions return it."""
    b, heads, _, d = query.shape
    out = query.new_empty((b, 1, heads, d))
    call, held = attention_call(query, key, value, mask, scale)
    call.out = out.data_ptr()
    library().lmt_decode_attention(call)
    del held
    return out


def attention_call(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[Attention, list[torch.Tensor]]:
    """`decode_attention`'s call (its `out` unset) and the tensors it reads, to be kept alive until it is made."""
    b, heads, _, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    keep, keep_stride = _keep(mask, length)
    scores = query.new_empty(length)
    call = Attention(query.data_ptr(), key.data_ptr(), value.data_ptr())
    call.q_stride[:] = query.stride()[:2]
    call.k_stride[:], call.v_stride[:] = key.stride()[:3], value.stride()[:3]
    call.keep, call.keep_stride = (keep.data_ptr() if keep is not None else None), keep_stride
    call.scores = scores.data_ptr()
    call.batch, call.heads, call.kv_heads, call.length, call.d, call.scale = b, heads, kv_heads, length, d, scale
    return call, [query, key, value, scores, *([keep] if keep is not None else [])]


def _keep(mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor | None, int]:
    """The boolean mask as (rows, keys) bytes and its row stride (0: one row for every batch row)."""
    if mask is None:
        return None, 0
    keep = mask.reshape(mask.shape[0], length)
    keep = keep if keep.stride(-1) == 1 else keep.contiguous()
    return keep, keep.stride(0) if keep.shape[0] > 1 else 0


# multiply-adds under which a product runs on one thread, by whether int4.c's threads are torch's
# OpenMP pool (True) or started per call (False). Started per call, on a 2-core AMD EPYC (torch's
# OpenMP workers spinning after each of torch's parallel regions), a decode step of the bundled
# packed model gave 29.4 tok/s all on one thread, 26.2 with its head on two (2**24) and 17.5 with
# every product over 2**20 on two; at 16 rows 2**27 and one thread 100 and 98 tok/s, 2**24 92.
SERIAL_WORK = {True: 1 << 18, False: 1 << 27}


def int4_mm(
    x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor, pieces: int, bits: int = 4, group: int = 32
) -> torch.Tensor:
    """x (rows, in) float32 times a packed GGUF layer's weights in panels of 64 output columns
    (lmtrace.model.gguf.nibbles): codes (panels, pieces * in * 8) int32 (4 bits) or (panels, in * 64)
    int8 (8 bits, one piece), scales_zeros (2, panels, pieces * in / group * 64) float32 (a scale per
    `group` input positions: 32, or 16 with 8 bits); (rows, panels *
    64) float32, each element computed the same way whatever the rows or threads. Inside
    torch.compile it is one opaque operation (`torch.ops.lmtrace.int4_mm`)."""
    if torch.compiler.is_compiling():
        return torch.ops.lmtrace.int4_mm(x, codes, scales_zeros, pieces, bits, group)
    return _int4_mm(x, codes, scales_zeros, pieces, bits, group)


def _int4_mm(
    x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor, pieces: int, bits: int, group: int
) -> torch.Tensor:
    x = x.contiguous()
    rows, width = x.shape
    panels = codes.shape[0]
    y = x.new_empty((rows, panels * 64))
    work = rows * width * pieces * panels * 64
    threads = torch.get_num_threads() if work >= SERIAL_WORK[bool(library().lmt_int4_openmp())] else 1
    scales = scales_zeros.data_ptr()  # scales_zeros[0] and [1] without making tensors of them (~4 us each)
    zeros = scales + scales_zeros.stride(0) * scales_zeros.element_size()
    product = Int4(
        x.data_ptr(), rows, width, codes.data_ptr(), scales, zeros, panels, pieces, y.data_ptr(), bits, group
    )
    library().lmt_int4_mm(product, threads)
    return y


@torch.library.custom_op("lmtrace::int4_mm", mutates_args=())
def _int4_mm_op(
    x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor, pieces: int, bits: int, group: int
) -> torch.Tensor:
    return _int4_mm(x, codes, scales_zeros, pieces, bits, group)


@_int4_mm_op.register_fake
def _int4_mm_shape(
    x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor, pieces: int, bits: int, group: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0] * 64))
