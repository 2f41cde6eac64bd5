"""`lmtrace export`: loads a model (the bundled GGUF, a .gguf, a folder, a hub id) and writes it
as a safetensors folder (lmtrace.model.folder) that transformers, lm-evaluation-harness's `hf`
backend or vLLM load to the same logits. It sits above the loader; the folder writer below it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmtrace.model.folder import check_out_dir, save_folder
from lmtrace.model.load import load


def export(source: str | Path | None, out_dir: str | Path, **load_kwargs: Any) -> Path:
    """Loads `source` (None: the bundled model; a .gguf, a folder, a hub id) with
    `lmtrace.load(source, **load_kwargs)` and writes it with `save_folder`. The dtype defaults
    to float32, in which a GGUF's dequantized weights are exact."""
    out = Path(out_dir).expanduser()
    check_out_dir(out)  # before spending the load
    load_kwargs.setdefault("dtype", "float32")
    return save_folder(load(source, **load_kwargs), out)
