"""The uncertainty options shared by `generate` and `sample`: --uncertainty, --confidence-k,
--confidence-window, --confidence-tail (checked before the model loads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from lmtrace.logits import sequence


def confidence_options(f: Callable | None = None, *, flag: bool = True) -> Callable:
    """The DeepConf settings (and, with `flag`, the --uncertainty switch)."""

    def decorate(g: Callable) -> Callable:
        g = click.option("--confidence-tail", type=int, default=2048, show_default=True,
                         help="Final tokens the tail confidence averages (capped at the length).")(g)  # fmt: skip
        g = click.option("--confidence-window", type=int, default=2048, show_default=True,
                         help="DeepConf's group: a sliding window of token confidences (capped).")(g)  # fmt: skip
        g = click.option("--confidence-k", type=int, default=20, show_default=True,
                         help="Top logprobs in a token's DeepConf confidence (the chosen one too).")(g)  # fmt: skip
        if flag:
            g = click.option("--uncertainty", is_flag=True,
                             help="Record each token's confidence, margin and varentropy and the answer's "
                             "scores (msp, perplexity, entropies, DeepConf's confidences).")(g)  # fmt: skip
        return g

    return decorate(f) if f is not None else decorate


def settings_from(kw: dict[str, Any]) -> dict[str, int]:
    """{k, window, tail} popped from the options and checked (k against the vocabulary later)."""
    out = {"k": kw.pop("confidence_k"), "window": kw.pop("confidence_window"), "tail": kw.pop("confidence_tail")}
    sequence.check(out["k"], out["window"], out["tail"])
    return out
