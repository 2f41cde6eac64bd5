"""transformers draws a plain tqdm bar ("Converting and de-quantizing GGUF tensors...") while it
reads a GGUF file, and "Loading weights" bars; TQDM_DISABLE is read only when tqdm is imported,
long before lmtrace runs. lmtrace says what a load does in one status line instead, and shows
its own progress line (bytes of tensors read / total, model/gguf/progress.py) when the reading
takes more than 2 s."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _progress(iterable: Any, desc: str | None = None, **_: Any) -> Iterator[Any]:
    """What transformers' GGUF reader gets for tqdm: the tensors, with lmtrace's progress line."""
    from lmtrace.model.gguf.progress import tensors

    return tensors(iterable, "reading and dequantizing the GGUF tensors")


@contextmanager
def quiet_gguf() -> Iterator[None]:
    """Within the block, transformers' GGUF loader and its weight-loading bar draw nothing."""
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no gguf package: no GGUF loading, no bar
        gguf_utils = None
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = gguf_utils.tqdm if gguf_utils is not None else None
    if gguf_utils is not None:
        gguf_utils.tqdm = _progress
    try:
        yield
    finally:
        if gguf_utils is not None:
            gguf_utils.tqdm = original
        if bars_were_on:
            hf_logging.enable_progress_bar()
