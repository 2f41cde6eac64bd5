"""Checks of a user's arguments that need no torch: the command line runs them before it imports
torch and transformers, so a typo is answered in a fraction of a second, not after a model load."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from lmtrace.errors import InvalidParameter

# a --dtype name -> the torch dtype's attribute name
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
DEVICES = ("auto", "cpu", "cuda", "mps")
Options = TypeVar("Options")


def device(name: str) -> None:
    if name not in DEVICES and not name.startswith("cuda:"):
        raise InvalidParameter(f"device must be one of {', '.join(DEVICES)}, got {name!r}")


def dtype(name: str) -> None:
    if name != "auto" and name not in DTYPE_NAMES:
        raise InvalidParameter(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {name!r}")


def step_selector(waterfall: int | str | None, max_new_tokens: int) -> Callable[[int], bool] | None:
    """`waterfall` as given by a user: a step index, "all", or None (off)."""
    if waterfall is None:
        return None
    if waterfall == "all":
        return lambda index: True
    if isinstance(waterfall, str) and waterfall.strip().isdigit():
        waterfall = int(waterfall)
    if isinstance(waterfall, bool) or not isinstance(waterfall, int) or not 0 <= waterfall < max_new_tokens:
        raise InvalidParameter(
            f"waterfall must be a step index in [0, {max_new_tokens - 1}] or 'all', got {waterfall!r}"
        )
    return lambda index: index == waterfall


BUNDLED_NAME = "SmolLM2-135M-Instruct (bundled)"
_TRUE = ("1", "true", "yes", "on")


def looks_like_path(text: str) -> bool:
    """A --model value meant as a file or folder rather than a hub id ("org/name")."""
    return text.endswith(".gguf") or text.startswith((".", "/", "~")) or text.count("/") > 1


def model_source(source: str | None) -> str:
    """Checks a --model value without torch and returns the model's name for a status line: a
    path must be a .gguf file or a folder with config.json; a hub id must be in the local Hugging
    Face cache unless the hub can be reached (so an offline miss is answered at once, not after
    transformers' retries)."""
    if source is None:
        return BUNDLED_NAME
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise InvalidParameter(f"model: {source!r} is a file but not a .gguf file; pass a .gguf file or a folder")
        return path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidParameter(f"model: {source!r} has no config.json, so it is not a Hugging Face model folder")
        return path.name or str(path)
    if looks_like_path(source):
        raise InvalidParameter(f"model: no such file or folder: {source!r}")
    if hub_cached(source) is None and not hub_reachable():
        raise InvalidParameter(f"model: {source!r} is not in the local Hugging Face cache ({hub_cache()}) and the "
                               f"hub cannot be reached from here, so it cannot be downloaded; download it where there "
                               f"is a network, or pass a local folder or .gguf file.")  # fmt: skip
    return source


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub finds it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_cached(repo_id: str) -> Path | None:
    """A snapshot folder of `repo_id` in the local cache that holds a config.json, if any."""
    snapshots = hub_cache() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
    return found[0].parent if found else None


def hub_reachable(timeout: float = 0.8) -> bool:
    """False when HF_HUB_OFFLINE is set or the hub's host cannot be connected to within `timeout`
    (a name that does not resolve fails in milliseconds); True behind a configured proxy."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", endpoint.port or 443), timeout).close()
    except OSError:
        return False
    return True


MAX_DRAFT_TOKENS = 16


def draft_spec(spec: str) -> str:
    """A --draft SPEC as given: "packed", "layers:N" (N >= 1), or a path / hub id (checked when
    it loads)."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidParameter(f"draft must be 'packed', 'layers:N' or a model path, got {spec!r}")
    if spec.startswith("layers:"):
        n = spec.split(":", 1)[1]
        if not n.strip().isdigit() or int(n) < 1:
            raise InvalidParameter(f"draft: 'layers:N' takes a number of layers N >= 1, got {spec!r}")
    return spec


def draft_tokens(k: int | str) -> int | str:
    """--draft-tokens K: proposals per block, in [1, 16], or "auto" (chosen per block from the
    run's measured costs and acceptance: lmtrace.decode.block_size)."""
    if k == "auto":
        return k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidParameter(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}] or 'auto', got {k!r}")
    return k


def against(value: str | int) -> tuple[str, int | str]:
    """--against: ("rank", N) for `rank:N` (N >= 1), ("id", i) for a token id, ("text", t) for a
    token's text (the tokenizer decides later whether it is one token)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidParameter(f"against: a token id must be >= 0, got {value}")
        return ("id", value)
    text = str(value)
    if text.startswith("rank:"):
        n = text[5:]
        if not n.isdigit() or int(n) < 1:
            raise InvalidParameter(f"against: rank:N needs a whole number N >= 1, got {text!r}")
        return ("rank", int(n))
    if text.isdigit():
        return ("id", int(text))
    if not text:
        raise InvalidParameter("against: needs a token text, a token id or rank:N, got ''")
    return ("text", text)


def split(cls: type, keywords: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`keywords` parted into those that are fields of the dataclass `cls` and the rest."""
    names = {f.name for f in dataclasses.fields(cls)}
    own = {k: v for k, v in keywords.items() if k in names}
    return own, {k: v for k, v in keywords.items() if k not in names}


def options(cls: type[Options], given: Options | None, entry: str, keywords: dict[str, Any]) -> Options:
    """An options dataclass from a caller's keywords: `given` (else `cls()`) with `keywords` laid
    over it. A keyword that is no field of `cls` is refused in one line naming it and `entry`."""
    own, rest = split(cls, keywords)
    for name in rest:
        raise InvalidParameter(f"{name}: {entry} does not take {name}")
    base = given if given is not None else cls()
    return dataclasses.replace(base, **own) if own else base
