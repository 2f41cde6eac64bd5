"""SDPA's own grouped-query attention inside a compiled decode step.

transformers' sdpa attention, for a model whose key/value heads serve several query heads,
repeats each key/value head for its query heads (`repeat_kv`) while torch.compile traces (its
one-query shortcut, `pack_gqa`, is off then). Over a static cache that copies every head's whole
cache at every layer and step: on SmolLM2-135M (3 key/value heads for 9 query heads, a 256-position
cache) about 1.4 ms of a 17 ms packed step. `grouped(model)` gives the model this attention
around a compiled call: a one-token query in a graph being compiled runs torch's
`scaled_dot_product_attention(..., enable_gqa=True)` over the cache as it is; anything else
(a prompt, an eager step, a position bias, a soft cap) runs transformers' own sdpa function, so
the default path's numbers do not move. The compiled paths are held to the default path within
5e-5 (tests/test_static_step.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.import_utils import is_torch_greater_or_equal

NAME = "lmtrace_grouped_sdpa"
SUPPORTED = is_torch_greater_or_equal("2.5")  # scaled_dot_product_attention's enable_gqa


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """(batch, heads, 1, dim) queries over (batch, kv_heads, keys, dim) keys and values ->
    (batch, 1, heads, dim), as transformers' sdpa function returns it."""
    plain = (
        not torch.compiler.is_compiling()
        or query.shape[2] != 1
        or getattr(module, "num_key_value_groups", 1) == 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (batch, heads, 1, dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa gets


@contextlib.contextmanager
def grouped(model: Any) -> Iterator[None]:
    """The model's sdpa attention swapped for `grouped_sdpa` inside (a model on another attention,
    or a torch without enable_gqa, as it is)."""
    config = model.config
    if not SUPPORTED or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
