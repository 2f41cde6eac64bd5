"""How `lmtrace.load` loads a model, as one object: `LoadOptions`. `load(source, **keywords)`
builds it from the keywords a caller has always passed; `load(source, options)` takes it whole.

    lm = lmtrace.load("model.gguf", device="cpu", weights="packed")
    lm = lmtrace.load("model.gguf", LoadOptions(device="cpu", weights="packed"))"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadOptions:
    """Everything `load` takes besides the source. `device_map="auto"` spreads the layers over
    the GPUs present (through accelerate) instead of putting the model on one `device`.
    `gguf_cache=False` reads a .gguf file itself rather than its converted safetensors copy.
    `status` is told, in a line, what the load does (converting, or loading the converted copy).
    `weights="packed"` runs a GGUF's own Q4_0/Q4_1/Q8_0 weights at 4 bits (CPU), not dequantized.
    `matmul="onednn"` computes the float32 linear layers with oneDNN on weights packed once;
    `matmul="onednn-fused"` also a Llama layer's small operations in C (lmtrace.model.fused).
    `batch_invariant=True` runs the batch-invariant operations (lmtrace.model.invariant)."""

    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    device_map: str | dict[str, Any] | None = None
    gguf_cache: bool = True
    status: Callable[[str], None] | None = None
    weights: str = "float"
    matmul: str = "default"
    batch_invariant: bool = False
