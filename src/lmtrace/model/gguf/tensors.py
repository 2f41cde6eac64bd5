"""A GGUF file's tensors, read without the gguf package's `GGUFReader`: that reader makes a numpy
object for every part of every metadata value (a Gemma 3 file's 262,144-token vocabulary became
~650 MB of Python objects and 15 s, each time a file was opened). Here the metadata is walked
with `struct` and skipped, keeping only `general.architecture` and `general.alignment`; each
tensor is a read-only numpy view of one memory map of the file, shaped as GGUFReader shapes it
(quantized types: uint8 rows of bytes), so gguf's `dequantize` reads it the same. `release`
drops a tensor's pages from this process's resident memory once it has been read (they stay in
the page cache and come back on the next access). Raises ValueError on a file whose metadata or
tensors run past its end, or that repeats a key or a tensor name."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# metadata value type -> fixed size in bytes (8: string, 9: array are walked)
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
PLAIN = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass
class Tensor:
    """One tensor as gguf's ReaderTensor gives it (the fields lmtrace reads)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ggml's order (innermost first)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # read-only view of the mapped file


class _Cursor:
    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf, self.pos, self.size = buf, pos, len(buf)

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise ValueError(f"metadata runs past the end of the file (at byte {start}, {n} bytes)")
        self.pos += n
        return start

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        n = self.unpack("<Q")
        start = self.take(n)
        return bytes(self.buf[start : start + n])

    def skip(self, vtype: int) -> None:
        if vtype == 8:
            self.take(self.unpack("<Q"))
        elif vtype == 9:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in SIZES:
                self.take(SIZES[item] * count)
            else:
                for _ in range(count):
                    self.skip(item)
        elif vtype in SIZES:
            self.take(SIZES[vtype])
        else:
            raise ValueError(f"unknown metadata value type {vtype}")


class GGUFTensors:
    """The tensors of the GGUF file at `path` (`.tensors`, in file order) and its
    `.architecture` (None when the file declares none)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._map)
        if bytes(self._map[:4]) != b"GGUF":
            raise ValueError("not a GGUF file")
        cur.take(8)
        n_tensors, n_keys = cur.unpack("<Q"), cur.unpack("<Q")
        self.architecture: str | None = None
        alignment, keys = 32, set()
        for _ in range(n_keys):
            key = cur.string().decode("utf-8", "replace")
            if key in keys:
                raise ValueError(f"duplicate metadata key {key}")
            keys.add(key)
            vtype = cur.unpack("<I")
            if key == "general.architecture" and vtype == 8:
                self.architecture = cur.string().decode("utf-8", "replace")
            elif key == "general.alignment" and vtype == 4:
                alignment = cur.unpack("<I") or 32
            else:
                cur.skip(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string().decode("utf-8", "replace")
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
        start = -(-cur.pos // alignment) * alignment
        self.tensors: list[Tensor] = []
        names: set[str] = set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise ValueError(f"duplicated tensor name {name}")
            names.add(name)
            block, type_size = GGML_QUANT_SIZES[kind]
            n = int(np.prod(dims, dtype=np.int64))
            n_bytes, at = n * type_size // block, start + offset
            if at + n_bytes > cur.size:
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors.append(
                Tensor(
                    name, kind, np.array(dims, dtype=np.uint64), n, n_bytes, at, self._view(kind, at, n, n_bytes, dims)
                )
            )

    def _view(self, kind: Any, at: int, n: int, n_bytes: int, dims: list[int]) -> np.ndarray:
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(dims))
        if kind.name in PLAIN:
            return np.frombuffer(self._map, dtype=PLAIN[kind.name], count=n, offset=at).reshape(shape)
        data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=at)
        return data.reshape(quant_shape_to_byte_shape(shape, kind))

    def release(self, tensor: Tensor) -> None:
        """Drops the pages of `tensor` from this process's resident memory (not from the file)."""
        release(tensor.data)


def trim_heap() -> None:
    """Gives the pages of memory the process freed back to the system (glibc's malloc_trim; a no-op
    elsewhere). Freed blocks of a few MB stay in malloc's heap, counted in the resident size, and
    a packed load frees one conversion buffer per tensor: trimmed as it goes, they do not pile up
    into the load's peak (Gemma 3 270M Q4_K_M: about 280 MB)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def release(view: np.ndarray) -> None:
    """Drops the pages under `view` (a numpy view of a GGUFTensors map) from this process's
    resident memory; they come back from the page cache on the next read. Any other array: a
    no-op."""
    base = view
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED") or view.nbytes == 0:
        return
    offset = view.ctypes.data - np.frombuffer(base, dtype=np.uint8, count=1).ctypes.data
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    base.madvise(mmap.MADV_DONTNEED, start, offset + view.nbytes - start)
