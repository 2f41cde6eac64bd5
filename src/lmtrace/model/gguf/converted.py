"""A GGUF file converted once into a safetensors folder in the user's cache, so that later loads
skip transformers' GGUF reader (it parses the file four times, walking the 49,152-entry
vocabulary element by element: ~36 s for the bundled model, against ~1 s from the folder).

The folder is `<cache>/gguf/<sha256 of the file>/` with the dequantized float32 weights, the
config and the tokenizer (lmtrace.model.folder.save_folder), and `lmtrace-cache.json` saying what it
was made from and with which versions. It is written in a temporary folder and renamed into
place, so a reader sees it whole or not at all; a folder whose record does not match is made
again. `<cache>` is $LMTRACE_CACHE, else $XDG_CACHE_HOME/lmtrace, else ~/.cache/lmtrace.
LMTRACE_GGUF_CACHE=0 turns the cache off.

Hashing ~100 MB costs ~0.3 s, so the hash is remembered in `<cache>/gguf/hashes.json`,
keyed by the file's resolved path, size and modification time."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmtrace.files import write_atomic

if TYPE_CHECKING:
    from lmtrace.model.lm import LM

FORMAT = 2  # bump when the folder's layout or the conversion changes
RECORD = "lmtrace-cache.json"
HASHES = "hashes.json"
Status = Callable[[str], None]


def cache_root() -> Path:
    """Where lmtrace keeps what it can rebuild: $LMTRACE_CACHE, $XDG_CACHE_HOME/lmtrace, ~/.cache/lmtrace."""
    if os.environ.get("LMTRACE_CACHE"):
        return Path(os.environ["LMTRACE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "lmtrace"


def enabled() -> bool:
    return os.environ.get("LMTRACE_GGUF_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    # the conversion is transformers' dequantization (and the gguf package's): another version
    # may give other bits, so the folder records them and is made again when they change
    return {"format": str(FORMAT), "transformers": version("transformers"), "gguf": version("gguf")}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_hash(path: str | Path) -> str:
    """The file's sha256, remembered by (resolved path, size, mtime) so a later run skips reading it."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    index_path = cache_root() / "gguf" / HASHES
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        if isinstance(index, dict) and isinstance(index.get(key), str):
            return index[key]
    except (OSError, ValueError):
        index = {}
    digest = _sha256(path)
    index = {k: v for k, v in index.items() if not k.startswith(f"{path}|")}  # the file's old versions
    index[key] = digest
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(index_path, json.dumps(index, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass  # a read-only cache still works; it only hashes again next time
    return digest


def folder_for(path: str | Path) -> Path:
    return cache_root() / "gguf" / file_hash(path)


def _record(path: Path, digest: str) -> dict[str, Any]:
    return {"source": path.name, "sha256": digest, "size": path.stat().st_size, **_versions()}


def is_ready(folder: Path, path: Path) -> bool:
    """True when `folder` holds a complete conversion of `path` made by these versions."""
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    expected = _record(path, folder.name)
    return all(record.get(k) == v for k, v in expected.items() if k != "source") and (folder / "config.json").is_file()


def ready_folder(path: str | Path) -> Path | None:
    """The converted folder for `path` if it exists and matches; never converts."""
    if not enabled():
        return None
    path = Path(path)
    try:
        folder = folder_for(path)
    except OSError:
        return None
    return folder if is_ready(folder, path) else None


def _convert(path: Path, folder: Path, load_gguf: Callable[[], LM], status: Status) -> None:
    """Loads the GGUF with `load_gguf` (transformers, float32 on the CPU: the dequantized values
    exactly), writes it into a temporary folder beside `folder`, then renames it into place."""
    from lmtrace.model.folder import save_folder

    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)  # an unwritable cache fails here, before the work
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        status(f"Converting {path.name} to safetensors, once (later runs load the converted copy)…")
        written = save_folder(load_gguf(), tmp / "model")
        write_atomic(written / RECORD, json.dumps(_record(path, folder.name), indent=2) + "\n")
        _replace(written, folder, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    status(f"{path.name}: converted to safetensors in {time.perf_counter() - started:.1f} s, once, into {folder}")


def _replace(new: Path, folder: Path, path: Path) -> None:
    """Renames `new` to `folder`; an old, mismatching folder is moved aside first. If another
    process got there first with a good folder, its folder stays (a reader may be loading it)
    and ours is dropped."""
    if is_ready(folder, path):
        return
    if folder.exists():
        aside = folder.with_name(f".{folder.name}.old.{os.getpid()}")
        try:
            os.rename(folder, aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(new, folder)
    except OSError:
        if not (folder / RECORD).is_file():
            raise


def source_of(folder: str | Path) -> str | None:
    """The GGUF file name a converted folder was made from (None: not a converted folder)."""
    try:
        record = json.loads((Path(folder) / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    source = record.get("source") if isinstance(record, dict) else None
    return source if isinstance(source, str) else None


def converted(path: str | Path, load_gguf: Callable[[], LM], status: Status | None = None) -> Path:
    """The safetensors folder for the GGUF at `path`, converting it first (with `load_gguf`,
    which loads the file itself in float32) if needed."""
    path = Path(path)
    say = status or (lambda _text: None)
    folder = folder_for(path)
    if is_ready(folder, path):
        say(f"{path.name}: from its converted copy in {folder}")
        return folder
    _convert(path, folder, load_gguf, say)
    return folder


def _meta_dir(path: Path) -> Path:
    return cache_root() / "gguf" / f"{file_hash(path)}.meta"


def ready_meta(path: str | Path) -> Path | None:
    """A folder with the GGUF's config and tokenizer alone (what a packed load needs besides the
    file's tensors; model/gguf/direct.py), if it exists and matches; else None."""
    if not enabled():
        return None
    path = Path(path)
    try:
        folder = _meta_dir(path)
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    expected = _record(path, file_hash(path))
    ok = all(record.get(k) == v for k, v in expected.items() if k != "source") and (folder / "config.json").is_file()
    return folder if ok else None


def save_meta(path: str | Path, config: Any, tokenizer: Any) -> None:
    """Keeps the config and tokenizer transformers parsed from the GGUF (minutes for a large
    vocabulary) beside the conversions, written whole or not at all; an unwritable cache is
    skipped silently (the next load parses the file again)."""
    if not enabled():
        return
    path = Path(path)
    try:
        folder = _meta_dir(path)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    except OSError:
        return
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_atomic(tmp / RECORD, json.dumps(_record(path, file_hash(path)), indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
