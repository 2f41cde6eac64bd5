"""Switching a model onto the batch-invariant operations and back: its float32 linear layers onto
the invariant products (products.py), its attention onto the invariant attention (attention.py).
RMSNorm, rotary embeddings, SiLU and the float32 log-softmax/entropy/top-k of lmtrace's measure
are row-wise already (checked bitwise, alone against among 2 to 16 rows)."""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.model import matmul
from lmtrace.model.invariant import attention, products

DESCRIPTION = "batch_invariant"


def active(model: Any) -> bool:
    """Whether `install` switched this model (and `remove` has not switched it back)."""
    return getattr(model, "lmtrace_batch_invariant", None) is not None


def check(model: Any) -> None:
    """Refuses, in one line naming both, what the invariant operations cannot run."""
    if matmul.describe(model) is not None:
        name = matmul.describe(model).split()[0]  # type: ignore[union-attr]
        raise InvalidParameter(f"batch_invariant: the model runs matmul {name!r} (its own fused layers); "
                               "the invariant mode runs its own oneDNN products: drop matmul")  # fmt: skip
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module) is not torch.nn.Linear:
            raise InvalidParameter(f"batch_invariant: the model's {type(module).__name__} layers (weights "
                                   "'packed') have no invariant kernel; load float weights")  # fmt: skip
        if type(module) is torch.nn.Linear and not products.eligible(module):
            w = module.weight
            raise InvalidParameter(f"batch_invariant: runs float32 on the CPU; this model is {w.dtype} on "
                                   f"{w.device.type} (dtype 'float32', device 'cpu')")  # fmt: skip
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ["sliding"]):
            raise InvalidParameter("batch_invariant: this model attends over a sliding window, "
                                   "which the invariant attention does not compute")  # fmt: skip


def install(model: Any) -> None:
    """Switches `model` onto the invariant operations (kept until `remove`)."""
    if active(model):
        return
    check(model)
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    saved = {"attention": model.config._attn_implementation, "forwards": {}}
    for m in layers:
        if "forward" in vars(m):  # a forward set on the instance (a user's patch): put back on remove
            saved["forwards"][m] = vars(m)["forward"]
        m.forward = types.MethodType(products.invariant_forward, m)
    model.config._attn_implementation = attention.NAME
    model.lmtrace_batch_invariant = saved


def remove(model: Any) -> None:
    """Puts the model back exactly as `install` found it."""
    saved = getattr(model, "lmtrace_batch_invariant", None)
    if saved is None:
        return
    for m in model.modules():
        if type(m) is torch.nn.Linear and "forward" in vars(m):
            del m.forward
            if m in saved["forwards"]:
                m.forward = saved["forwards"][m]
            if hasattr(m, "_lmtrace_onednn"):
                del m._lmtrace_onednn  # the packed copy made for the invariant products
    model.config._attn_implementation = saved["attention"]
    del model.lmtrace_batch_invariant


@contextmanager
def batch_invariant(model: Any) -> Iterator[Any]:
    """`with lmtrace.batch_invariant(model):` runs a plain transformers model (a trainer's: gradients
    on, any padding, any batch) on the operations `lmtrace.load(batch_invariant=True)` and
    `lmtrace serve --batch-invariant` decode with, so the log-softmax of its logits at a rollout's
    tokens equals the logprobs they reported, bit for bit. Leaving restores the model exactly.
    A model already switched (loaded with batch_invariant=True) stays switched."""
    model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    was = active(model)
    install(model)
    try:
        yield model
    finally:
        if not was:
            remove(model)
