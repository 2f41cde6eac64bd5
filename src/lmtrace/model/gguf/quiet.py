"""transformers draws a plain tqdm bar ("Converting and de-quantizing GGUF tensors...") while it
reads a GGUF file, and "Loading weights" bars; TQDM_DISABLE is read only when tqdm is imported,
long before lmtrace runs. lmtrace says what a load does in one status line instead."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager


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
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if gguf_utils is not None:
            gguf_utils.tqdm = original
        if bars_were_on:
            hf_logging.enable_progress_bar()
