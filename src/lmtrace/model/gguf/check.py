"""Checks a GGUF file before transformers reads it, so that a corrupt or hostile file gives one
clear line naming the file instead of a traceback, a hang or a huge allocation. The header is
read by hand (magic, version, counts against the file size); the rest by model/gguf/tensors.py,
which walks the metadata and checks every read and every tensor against the file's end."""

from __future__ import annotations

import struct
from pathlib import Path

from lmtrace.errors import ModelLoadError

HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key count
VERSIONS = (2, 3)
# the smallest a metadata entry or a tensor description can be on disk, in bytes
MIN_KV, MIN_TENSOR = 8 + 1 + 4 + 1, 8 + 1 + 4 + 8 + 4 + 8


def check_header(path: Path) -> tuple[int, int, int]:
    """(version, tensors, keys) of a plausible GGUF header; raises ModelLoadError otherwise."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) >= 4 and head[:4] != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    if len(head) < HEADER.size:
        raise ModelLoadError(f"{path}: truncated GGUF header ({size} bytes; the header alone needs {HEADER.size})")
    _, version, tensors, keys = HEADER.unpack(head)
    if version not in VERSIONS:
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (lmtrace reads versions 2 and 3)")
    if tensors * MIN_TENSOR > size or keys * MIN_KV > size:
        raise ModelLoadError(
            f"{path}: corrupt GGUF header: it declares {tensors} tensors and {keys} metadata keys, "
            f"more than a file of {size} bytes can hold"
        )
    return version, tensors, keys


def _explain(e: Exception) -> str:
    text = " ".join(str(e).split())
    if text.startswith(("duplicate", "metadata runs past", "tensor ")):  # model/gguf/tensors.py's own
        return text[:160]
    if "reshape" in text or "out of bounds" in text or "divisor" in text:
        return f"tensor data or metadata runs past the end of the file ({text[:120]})"
    return f"{type(e).__name__}: {text[:160]}"


def check_gguf(path: str | Path) -> None:
    """Raises ModelLoadError (one line naming the file) unless `path` reads as a GGUF file."""
    path = Path(path)
    check_header(path)
    try:
        import gguf  # noqa: F401  (GGUFTensors reads the type table from it)
    except ImportError as e:
        raise ModelLoadError("gguf: loading a .gguf file needs the gguf package: pip install gguf") from e
    from lmtrace.model.gguf.tensors import GGUFTensors

    try:
        reader = GGUFTensors(path)
    except Exception as e:  # the reader's own errors are many and unhelpful: translate them
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file: {_explain(e)}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: tensor {t.name} runs past the end of the file (truncated?)")
