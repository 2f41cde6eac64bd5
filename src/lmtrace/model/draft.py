"""Draft models for speculative decoding (`lmtrace.generate(..., draft=SPEC)`):

    packed      the target's own GGUF file run on its 4-bit blocks (lmtrace.model.gguf.packed)
    layers:N    self-speculative: the target's first N decoder layers, its final norm and head
                (the same weights, no copy; its own cache)
    PATH | ID   another model with the same tokenizer (a different vocabulary is refused)

A draft is loaded once per target and kept on it (`LM.drafts`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from lmtrace import arguments
from lmtrace.errors import InvalidParameter
from lmtrace.model.lm import LM


@dataclass
class Draft:
    """A draft model beside its target: `model` proposes, `spec` says what it is."""

    model: Any
    spec: str
    source: str
    layers: int
    weights: str  # "float", "packed"

    def describe(self) -> dict[str, Any]:
        """The trace's `speculative.draft_model`."""
        return {"spec": self.spec, "source": self.source, "layers": self.layers, "weights": self.weights}


def draft_for(target: LM, spec: str | LM | Draft) -> Draft:
    """The draft named by `spec` for `target`: loaded on first use, then kept on the target. An
    LM passes as a draft model (its vocabulary checked); a Draft is returned as it is."""
    if isinstance(spec, Draft):
        return spec
    if isinstance(spec, LM):
        check_vocabulary(target, spec, spec.source)
        return Draft(spec.model, spec.source, spec.source, spec.summary.layers, _weights(spec.model))
    arguments.draft_spec(spec)
    if spec not in target.drafts:
        target.drafts[spec] = _load(target, spec)
    return target.drafts[spec]


def _load(target: LM, spec: str) -> Draft:
    if spec == "packed":
        from lmtrace.model.gguf.packed import PackedHead
        from lmtrace.model.load import load

        path = gguf_path(target)
        lm = load(str(path), device="cpu", dtype="float32", weights="packed")
        head = lm.model.get_output_embeddings()
        if isinstance(head, PackedHead):  # a proposal needs no float32 logits: q is what the draft gives
            head.refine = 0
        return Draft(lm.model, spec, str(path), lm.summary.layers, "packed")
    if spec.startswith("layers:"):
        n = int(spec.split(":", 1)[1])
        return Draft(first_layers(target.model, n), spec, target.source, n, _weights(target.model))
    from lmtrace.model.load import load

    device = str(next(target.model.parameters()).device)
    lm = load(spec, device=device, dtype=target.summary.dtype or "auto")
    check_vocabulary(target, lm, spec)
    return Draft(lm.model, spec, lm.source, lm.summary.layers, _weights(lm.model))


def gguf_path(target: LM) -> Path:
    """The GGUF file the target was loaded from; `packed` needs one."""
    from lmtrace.model.load import bundled_gguf

    if target.source.startswith("bundled:"):
        return bundled_gguf()
    path = Path(target.source).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise InvalidParameter(
        f"draft: 'packed' runs the target's own GGUF file at 4 bits; the target {target.source!r} is not a .gguf file"
    )


def check_vocabulary(target: LM, draft: LM, name: str) -> None:
    """A draft must share the target's tokenizer: the same token for every id."""
    mine, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        first = f"; first difference at id {differ[0][1]}" if differ else ""
        raise InvalidParameter(
            f"draft: {name!r} has another vocabulary than the target ({len(theirs)} tokens against "
            f"{len(mine)}{first}); a draft must use the target's tokenizer"
        )


def first_layers(model: nn.Module, n: int) -> nn.Module:
    """A shallow copy of `model` that runs only its first `n` decoder layers, then the final norm
    and the head: every weight shared, nothing copied; its config says n layers, so a cache made
    from it has n layers."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        name = type(model).__name__
        raise InvalidParameter(f"draft: 'layers:{n}' needs a decoder with model.layers; {name} has none")
    total = len(layers)
    if not 1 <= n < total:
        raise InvalidParameter(f"draft: 'layers:N' takes N in [1, {total - 1}] for this {total}-layer model, got {n}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:n])
    short_inner = copy.copy(inner)
    short_inner._modules = dict(inner._modules)  # its own module table: replacing layers leaves the target's
    short_inner.layers = nn.ModuleList(list(layers[:n]))
    short_inner.config = config
    short = copy.copy(model)
    short._modules = dict(model._modules)
    short.model = short_inner
    short.config = config
    return short


def _weights(model: Any) -> str:
    return "packed" if getattr(model, "lmtrace_packed", None) is not None else "float"
