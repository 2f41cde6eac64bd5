"""Hands the exact weights lmtrace traced to other tools: a safetensors folder (config.json,
tokenizer files, model.safetensors) that transformers, lm-evaluation-harness's `hf` backend or
vLLM load to the same logits.

`model.save_pretrained` refuses a GGUF-loaded model ("quantized with gguf and is not
serializable"), although transformers has already dequantized every weight to a plain tensor:
so the folder is written here from the state dict, the config and the tokenizer.

    lm = lmtrace.load("model.gguf", dtype="float32")
    save_folder(lm, "out/")                # lmtrace export --model M out/ on the command line

This module writes a loaded model; `lmtrace export` (cli/export.py) loads and then writes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmtrace.errors import InvalidParameter, ModelLoadError

if TYPE_CHECKING:
    from lmtrace.model.lm import LM

WEIGHTS = "model.safetensors"
# config entries that describe how the source was stored, not the model: a loader reading the
# folder must not think it is still quantized, nor look for the original file
_DROP_FROM_CONFIG = ("quantization_config", "_name_or_path", "name_or_path")


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidParameter(f"out_dir: {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise InvalidParameter(f"out_dir: {str(out)!r} is not empty; give a new or empty folder")


def _unique_tensors(model: Any) -> dict[str, Any]:
    """The state dict without tied aliases (lm_head.weight is embed_tokens.weight when the config
    ties them; safetensors refuses to store one tensor under two names, and transformers ties
    them again on load). Tensors go to the CPU, contiguous, in the dtype the model runs in."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out: dict[str, Any] = {}
    for name, tensor in model.state_dict().items():
        if tensor.device.type == "meta":
            raise ModelLoadError(f"export: weight {name} is not in memory (offloaded by a device map); load it whole")
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            if not tied:
                raise ModelLoadError(f"export: {name} shares its memory with {seen[key]}, but the config ties nothing")
            continue
        seen[key] = name
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _config_dict(lm: LM, dtype: str) -> dict[str, Any]:
    data = lm.model.config.to_dict()
    for key in _DROP_FROM_CONFIG:
        data.pop(key, None)
    data["dtype"] = dtype  # what the weights are stored in: dtype="auto" loads them unchanged
    return data


def _write_folder(lm: LM, tmp: Path) -> None:
    from safetensors.torch import save_file

    tensors = _unique_tensors(lm.model)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    config = _config_dict(lm, dtype)
    if not config.get("architectures"):  # vLLM and others pick the model class from this
        config["architectures"] = [type(lm.model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    lm.model.generation_config.save_pretrained(str(tmp))
    lm.tokenizer.save_pretrained(str(tmp))
    _portable_tokenizer_config(tmp / "tokenizer_config.json")
    mode = 0o666 & ~_umask()
    for path in tmp.iterdir():
        os.chmod(path, mode)  # safetensors writes 0o600 files


def _portable_tokenizer_config(path: Path) -> None:
    """transformers 5 names its fast tokenizer class TokenizersBackend, which transformers 4
    (what vLLM or lm-eval may run on) does not know; PreTrainedTokenizerFast is the same class
    under the name both know. The keys recording where it was loaded from do not travel."""
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_folder(lm: LM, out_dir: str | Path) -> Path:
    """Writes `lm` as a safetensors folder with config and tokenizer at `out_dir` (new or empty),
    atomically: the folder appears complete or not at all. Returns its path."""
    out = Path(out_dir).expanduser()
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_folder(lm, tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0o700 folders
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename cannot replace a folder on every OS
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
