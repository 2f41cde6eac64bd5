"""Steering vectors from contrast prompts: the mean residual after a decoder layer over the
positive texts minus the same over the negative texts (each text's residual the mean over its
own tokens), as `lmtrace steer-vector` writes them and `--steer L:FILE:ALPHA` reads them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.files import write_atomic_bytes
from lmtrace.inside import lens
from lmtrace.inside.hooks import hooked
from lmtrace.model.lm import LM


def mean_residual(lm: LM, texts: Sequence[str], layer: int, last: bool = False) -> torch.Tensor:
    """(hidden,) float32: the mean over texts of each text's mean residual after `layer` (with
    `last`, each text's residual at its last position)."""
    kept: list[torch.Tensor] = []

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        kept.append(h[0, -1].float() if last else h[0].float().mean(0))  # (1, seq, hidden) -> (hidden,)

    with hooked(lm.model, f"blocks.{layer}.resid_post", hook), torch.inference_mode():
        for text in texts:
            ids = list(lm.tokenizer(text)["input_ids"])
            if not ids:
                raise InvalidParameter(f"steer-vector: the text {text!r} has no tokens")
            lm.model(input_ids=torch.tensor([ids], device=lm.model.device))
    return torch.stack(kept).mean(0).cpu()


def last_residual(lm: LM, text: str, layer: int) -> torch.Tensor:
    """(hidden,) the residual after `layer` at the last position of `text` (as generate encodes it)."""
    return mean_residual(lm, [text], layer, last=True)


def steer_vector(lm: LM, positive: Sequence[str], negative: Sequence[str], layer: int) -> torch.Tensor:
    """The mean difference of residuals after decoder `layer` (0-based): positive − negative."""
    layers = len(lens.unembedding(lm.model).layers)
    if not 0 <= layer < layers:
        raise InvalidParameter(f"layer must be in 0..{layers - 1}, got {layer}")
    if not positive or not negative:
        raise InvalidParameter("steer-vector needs at least one --positive and one --negative text")
    return mean_residual(lm, positive, layer) - mean_residual(lm, negative, layer)


def save_vector(path: str | Path, vector: torch.Tensor, layer: int, about: dict[str, Any]) -> None:
    """{vector, layer, ...about} written atomically with torch.save."""
    import io

    buf = io.BytesIO()
    torch.save({"vector": vector.contiguous(), "layer": layer, **about}, buf)
    write_atomic_bytes(path, buf.getvalue())
