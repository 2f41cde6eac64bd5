"""vLLM loads a model from a folder (config, tokenizer, safetensors). A folder given as the
model is used as it is; anything else lmtrace loads (the bundled GGUF, a .gguf file, a hub id)
is written once to `<cache>/vllm/<key>/` (lmtrace's cache, lmtrace.model.gguf.converted.cache_root) with
lmtrace.model.folder.save_folder, the weights exactly as lmtrace traced them, and reused while the
source file (path, size, modification time) and the dtype are unchanged."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.model.gguf.converted import cache_root


def is_model_folder(source: str | Path | None) -> bool:
    return source is not None and (Path(source).expanduser() / "config.json").is_file()


def _identity(source: str | None, dtype: str) -> dict[str, Any]:
    """What the exported folder depends on: the source file (path, size, time) and the dtype."""
    from lmtrace.model.load import bundled_gguf

    path = bundled_gguf() if source is None else Path(source).expanduser()
    if path.exists():
        st = path.resolve().stat()
        return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype}
    return {"hub_id": source, "dtype": dtype}


def model_folder(lm: Any, source: str | None) -> Path:
    """The folder vLLM loads: `source` itself when it is a model folder, else lmtrace's export
    of `lm` (the model as loaded from `source`) in the cache."""
    if is_model_folder(source):
        return Path(source).expanduser().resolve()
    identity = _identity(source, lm.summary.dtype or "float32")
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    out = cache_root() / "vllm" / key
    if (out / "config.json").is_file():
        return out
    from lmtrace.model.folder import save_folder

    try:
        return save_folder(lm, out)
    except InvalidParameter:
        if (out / "config.json").is_file():  # another job wrote it at the same time
            return out
        raise
