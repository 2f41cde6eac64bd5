"""Compiles kernels.c, int4.c and layer.c once per source, compiler flags and CPU into lmtrace's cache and
loads them as one library."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from lmtrace.errors import InvalidParameter
from lmtrace.model.gguf.converted import cache_root

SOURCES = [Path(__file__).with_name(name) for name in ("kernels.c", "int4.c", "layer.c")]
HEADER = Path(__file__).with_name("kernels.h")  # the structs they share
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread"]
# with glibc's vector math library SiLU's exp runs on 8 lanes; without it (another libc) on one; with
# OpenMP int4.c's threads are torch's own pool (the same libgomp.so.1, loaded by torch first)
VECTOR = (["-DLMT_MVEC"], ["-lmvec", "-lm"])
SCALAR = ([], ["-lm"])
ATTEMPTS = [(["-fopenmp", *VECTOR[0]], VECTOR[1]), (["-fopenmp"], SCALAR[1]), VECTOR, SCALAR]


def compiler() -> str:
    """The C compiler: $CC where set, else cc or gcc; one line naming onednn-fused where there is none."""
    asked = os.environ.get("CC")
    for name in [asked] if asked else ["cc", "gcc"]:
        found = shutil.which(name)
        if found:
            return found
    raise InvalidParameter(
        f"matmul: 'onednn-fused' compiles its kernels with a C compiler; none found ({asked or 'cc, gcc'})"
    )


def _cpu() -> str:
    """What -march=native compiles for: the CPU's flags (a library built on one CPU may not run on another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(cc: str) -> str:
    sources = [source.read_bytes() for source in [*SOURCES, HEADER]]
    flags = " ".join(FLAGS) + repr(ATTEMPTS)
    parts = [*sources, flags.encode(), cc.encode(), _cpu().encode(), platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compile(cc: str, out: Path) -> None:
    """Builds the library under a temporary name beside `out`, then renames it: never half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=out.parent)
    os.close(fd)
    errors = []
    try:
        for defines, libs in ATTEMPTS:
            try:
                command = [cc, *FLAGS, *defines, *map(str, SOURCES), "-o", tmp, *libs]
                run = subprocess.run(command, capture_output=True, text=True)
            except OSError as e:
                errors.append([str(e)])
                continue
            if run.returncode == 0:
                os.replace(tmp, out)
                return
            errors.append(run.stderr.strip().splitlines()[-1:] or ["?"])
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    raise InvalidParameter(f"matmul: 'onednn-fused' could not compile its kernels with {cc}: {errors[-1][0]}")


@cache
def library() -> ctypes.CDLL:
    """The compiled kernels, built at the first call (a few tenths of a second) and kept in the cache."""
    cc = compiler()
    path = cache_root() / "kernels" / f"fused-{_key(cc)}.so"
    if not path.exists():
        _compile(cc, path)
    lib = ctypes.CDLL(str(path))
    p, n = ctypes.c_void_p, ctypes.c_long
    norm, attention = ctypes.POINTER(Norm), ctypes.POINTER(Attention)
    lib.lmt_rms_norm.argtypes = [p, p, n, n, norm]
    lib.lmt_add_rms_norm.argtypes = [p, p, p, p, n, n, norm]
    lib.lmt_silu_mul.argtypes = [p, n, p, n, n]
    lib.lmt_rotary.argtypes = [p, n, p, p, p, n, n, n]
    lib.lmt_decode_attention.argtypes = [attention]
    lib.lmt_int4_mm.argtypes = [ctypes.POINTER(Int4), ctypes.c_int]
    lib.lmt_int4_openmp.argtypes, lib.lmt_int4_openmp.restype = [], ctypes.c_int
    lib.lmt_layer_qkv.argtypes = [ctypes.POINTER(Layer), p, n, p, p, p, p]
    lib.lmt_layer_rest.argtypes = [ctypes.POINTER(Layer), Attention, p, n, p]
    for fn in (
        lib.lmt_rms_norm,
        lib.lmt_add_rms_norm,
        lib.lmt_silu_mul,
        lib.lmt_rotary,
        lib.lmt_decode_attention,
        lib.lmt_int4_mm,
        lib.lmt_layer_qkv,
        lib.lmt_layer_rest,
    ):
        fn.restype = None
    return lib


class Norm(ctypes.Structure):
    """kernels.c's lmt_norm: an RMSNorm's weight, epsilon and the width of torch's vectors."""

    _fields_ = [("weight", ctypes.c_void_p), ("eps", ctypes.c_float), ("lanes", ctypes.c_int)]


class Attention(ctypes.Structure):
    """kernels.c's lmt_attention: a decode step's attention, its tensors' addresses, strides and shape."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("q_stride", ctypes.c_long * 2),
        ("k_stride", ctypes.c_long * 3),
        ("v_stride", ctypes.c_long * 3),
        ("keep", ctypes.c_void_p),
        ("keep_stride", ctypes.c_long),
        ("out", ctypes.c_void_p),
        ("scores", ctypes.c_void_p),
        ("batch", ctypes.c_long),
        ("heads", ctypes.c_long),
        ("kv_heads", ctypes.c_long),
        ("length", ctypes.c_long),
        ("d", ctypes.c_long),
        ("scale", ctypes.c_float),
    ]


class Int4(ctypes.Structure):
    """int4.c's lmt_int4: a packed GGUF layer's product, its input, 4-bit codes, scales and zeros."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("rows", ctypes.c_long),
        ("in_features", ctypes.c_long),
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("zeros", ctypes.c_void_p),
        ("panels", ctypes.c_long),
        ("pieces", ctypes.c_int),
        ("y", ctypes.c_void_p),
        ("bits", ctypes.c_int),  # 4 or 8
        ("group", ctypes.c_int),  # input positions a scale covers: 32, or 16 (8 bits, Q6_K)
    ]


class Layer(ctypes.Structure):
    """layer.c's lmt_layer: the layer's norms and products (their x, rows and y set per call) and shape."""

    _fields_ = [
        ("input_norm", Norm),
        ("post_norm", Norm),
        ("qkv", Int4),
        ("o", Int4),
        ("gate_up", Int4),
        ("down", Int4),
        ("hidden", ctypes.c_long),
        ("heads", ctypes.c_long),
        ("kv_heads", ctypes.c_long),
        ("head_dim", ctypes.c_long),
        ("inter", ctypes.c_long),
        ("scale", ctypes.c_float),
        ("threads", ctypes.c_int),
        ("serial_work", ctypes.c_long),
    ]
