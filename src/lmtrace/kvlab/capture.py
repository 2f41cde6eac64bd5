"""Attention weights for the policies, taken without changing a single logit: a registered
attention function calls the model's own implementation (sdpa, eager, ...) for the output and,
beside it, computes softmax(q·kᵀ·scale) eagerly for the queries the recorder asks for.

transformers looks attention up by `config._attn_implementation`; `capturing` switches it to
"lmtrace_kvlab_<original>" (with the original's mask function) for the duration of a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

PREFIX = "lmtrace_kvlab_"


class Recorder:
    """Per layer, the attention of the last forward pass summed over the recorded queries and
    averaged over heads: `last` (the final query), `total` (all queries), `window` (the last
    `window` queries). Each is (batch, key_len) float32, or absent for a layer not seen."""

    def __init__(self, window: int = 1, total: bool = False):
        self.window = max(1, window)
        self.want_total = total
        self.active = True
        self.last: dict[int, torch.Tensor] = {}
        self.total: dict[int, torch.Tensor] = {}
        self.window_sum: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.last, self.total, self.window_sum = {}, {}, {}

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: Any, scaling: float) -> None:
        q_len, k_len = query.shape[-2], key.shape[-2]
        rows = q_len if self.want_total else min(q_len, self.window)
        q = query[:, :, q_len - rows :].float()  # (b, heads, rows, d)
        groups = q.shape[1] // key.shape[1]
        k = key.float().repeat_interleave(groups, dim=1)  # (b, heads, k_len, d)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (b, heads, rows, k_len)
        scores = scores + _bias(mask, q_len, k_len, rows, scores.device)
        weights = torch.softmax(scores, dim=-1).mean(dim=1)  # (b, rows, k_len)
        self.last[layer] = weights[:, -1]
        self.window_sum[layer] = weights[:, -min(rows, self.window) :].sum(dim=1)
        if self.want_total:
            self.total[layer] = weights.sum(dim=1)


def _bias(mask: Any, q_len: int, k_len: int, rows: int, device: torch.device) -> torch.Tensor:
    """(…, rows, k_len) additive bias: the model's own mask where it passed one, else causal
    with the queries at the end of the keys (sdpa may get no mask and `is_causal`)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        m = mask[..., q_len - rows :, -k_len:]
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, device=device).masked_fill(~m.to(device), float("-inf"))
        return m.float().to(device)
    q_pos = torch.arange(k_len - rows, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return torch.zeros((rows, k_len), device=device).masked_fill(k_pos > q_pos, float("-inf"))


_RECORDER: list[Recorder | None] = [None]


def _wrapped(original: str) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        if original == "sdpa":
            inner = sdpa_attention_forward
        else:
            inner = ALL_ATTENTION_FUNCTIONS.get_interface(original, eager_attention_forward)
        out = inner(module, query, key, value, attention_mask, **kwargs)
        recorder = _RECORDER[0]
        if recorder is not None and recorder.active:
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            with torch.no_grad():
                recorder.record(int(module.layer_idx), query, key, attention_mask, scaling)
        return out

    return attention


def _register(original: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = PREFIX + original
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(name, _wrapped(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def use(recorder: Recorder | None) -> None:
    """The recorder the next forward passes write to (None: record nothing)."""
    _RECORDER[0] = recorder


@contextmanager
def capturing(model: Any, recorder: Recorder | None = None) -> Iterator[Recorder | None]:
    """Within the block, forward passes of `model` record attention into `recorder` (or the
    one set by `use`); the model's own attention computes every output."""
    config = model.config
    original = config._attn_implementation or "eager"
    if original.startswith(PREFIX):
        original = original[len(PREFIX) :]
    config._attn_implementation = _register(original)
    previous, _RECORDER[0] = _RECORDER[0], recorder
    try:
        yield recorder
    finally:
        _RECORDER[0] = previous
        config._attn_implementation = original
