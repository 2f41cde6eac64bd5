"""The one module that puts hooks on a model: named hook points, one per site of the forward (as
TransformerLens's `HookPoint`s), each resolved to the module and the side of it that holds it.

    with Hooks(model) as h:                        # every hook added is removed on leaving
        h.add("blocks.3.resid_post", fn)           # fn(module, args, output) -> None | new output
        h.add("blocks.0.resid_pre", fn)            # fn(module, args, kwargs) -> None | (args, kwargs)
        model(...)

Points (i: the 0-based decoder layer):

    model.in, model.out          the whole model's input (its keyword arguments) and its output
    embed                        the input embeddings' output
    blocks.{i}.resid_pre         the residual stream entering layer i (its input hidden states)
    blocks.{i}.resid_post        the residual stream leaving layer i (its output)
    blocks.{i}.attn_out          what the attention writes into the residual (Gemma-2: after its
                                 sandwich norm)
    blocks.{i}.mlp_out           what the MLP writes into the residual (Gemma-2: after its norm)
    blocks.{i}.attn.z            the heads' outputs, concatenated: the output projection's input
    blocks.{i}.attn.o            the output projection's output entering the sandwich norm (Gemma-2)
    norm.in, norm.out            the final norm's input and output
    unembed                      the lm_head's output (the logits)

A point on an input side is a forward pre-hook (with keyword arguments), one on an output side a
forward hook: the hooks run inside the model's own forward, so every number is the model's own."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

from lmtrace.errors import InvalidParameter

INPUT, OUTPUT = "input", "output"
# a block's point -> (which of its modules, which side)
BLOCK_POINTS = {
    "resid_pre": ("layer", INPUT),
    "resid_post": ("layer", OUTPUT),
    "attn_out": ("attn", OUTPUT),
    "mlp_out": ("mlp", OUTPUT),
    "attn.z": ("o_proj", INPUT),
    "attn.o": ("post", INPUT),
}
# a model-wide point -> (which module, which side)
MODEL_POINTS = {
    "model.in": ("model", INPUT),
    "model.out": ("model", OUTPUT),
    "embed": ("embed", OUTPUT),
    "norm.in": ("norm", INPUT),
    "norm.out": ("norm", OUTPUT),
    "unembed": ("head", OUTPUT),
}

Hook = Callable[..., Any]


class Hooks:
    """Hooks at named points of one model, removed together (`remove`, or leaving the `with`).

    `un` and `blocks` (inside.lens.unembedding's and inside.attribution.blocks's answers) may be
    given where the caller has them already; otherwise they are found on first use."""

    def __init__(self, model: Any = None, *, un: Any = None, blocks: list[Any] | None = None):
        self.model = model
        if un is not None:
            self.un = un
        if blocks is not None:
            self.blocks = blocks
        self.handles: list[Any] = []

    @cached_property
    def un(self) -> Any:
        from lmtrace.inside import lens  # lens registers its hooks here: imported when first needed

        return lens.unembedding(self.model)

    @cached_property
    def blocks(self) -> list[Any]:
        from lmtrace.inside import attribution  # as lens

        return attribution.blocks(self.model)

    def site(self, name: str) -> tuple[Any, str]:
        """(module, side) of the point `name`; InvalidParameter naming it where the model has none."""
        if name in MODEL_POINTS:
            where, side = MODEL_POINTS[name]
            return self._model_module(where), side
        parts = name.split(".", 2)
        point = BLOCK_POINTS.get(parts[2]) if len(parts) == 3 and parts[0] == "blocks" else None
        if point is None or not parts[1].isdigit():
            known = f"{', '.join(MODEL_POINTS)} or blocks.I.{{{', '.join(BLOCK_POINTS)}}}"
            raise InvalidParameter(f"hook point must be one of {known}, got {name!r}")
        i, (where, side) = int(parts[1]), point
        if i >= len(self.un.layers):
            raise InvalidParameter(f"hook point {name!r}: the model has {len(self.un.layers)} layers")
        module = self.un.layers[i] if where == "layer" else getattr(self.blocks[i], where)
        if module is None:
            raise InvalidParameter(f"hook point {name!r}: layer {i} has no such module")
        return module, side

    def _model_module(self, where: str) -> Any:
        if where == "model":
            return self.model
        if where == "embed":
            return self.model.get_input_embeddings()
        return getattr(self.un, where)

    def add(self, name: str, fn: Hook) -> Any:
        """Puts `fn` at point `name`; returns its torch handle (removed with the others too)."""
        module, side = self.site(name)
        if side == INPUT:
            handle = module.register_forward_pre_hook(fn, with_kwargs=True)
        else:
            handle = module.register_forward_hook(fn)
        self.handles.append(handle)
        return handle

    def remove(self) -> None:
        """Removes every hook this object added."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def hooked(model: Any, name: str, fn: Hook) -> Hooks:
    """One hook at point `name` of `model`, as a Hooks to remove it (or to leave a `with`)."""
    hooks = Hooks(model)
    hooks.add(name, fn)
    return hooks
