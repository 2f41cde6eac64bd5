"""Changes to the forward, applied through forward hooks for as long as they are attached:

    ablate L.attn   zero layer L's attention write into the residual stream (Gemma-2: after its norm)
    ablate L.mlp    zero layer L's MLP write
    ablate L.hH     zero head H's output before the output projection (its slice of o_proj's input)
    steer L:F:A     add A × the vector in file F to the residual after decoder layer L, every position
    patch           set the residual after layer L at one position (the prompt's last) to a given
                    vector (another prompt's residual there: activation patching)

Layers are the 0-based decoder layers, as in attribution's `L{i}.attn`. The hooks act on every
forward while attached — the prefill and each cached decoding step — so the keys and values a
later step reads from the cache were computed under the intervention, exactly as a full
recompute with it would compute them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.inside import attribution, lens
from lmtrace.inside.hooks import Hooks


@dataclass
class Intervention:
    """One change: `kind` ablate_attn, ablate_mlp, ablate_head or steer, at decoder `layer`."""

    kind: str
    layer: int
    head: int | None = None
    vector: torch.Tensor | None = None  # (hidden,) for steer
    alpha: float = 0.0
    spec: str = ""
    position: int | None = None  # for patch: the absolute position whose residual is replaced


def parse_ablate(spec: str, model: Any) -> Intervention:
    """`L.attn`, `L.mlp` or `L.hH`, checked against the model's layers and heads."""
    layer, _, what = spec.partition(".")
    bs = attribution.blocks(model)
    if not layer.isdigit() or not what:
        raise InvalidParameter(f"ablate must be L.attn, L.mlp or L.hH, got {spec!r}")
    i = _layer(int(layer), len(bs), "ablate", spec)
    if what in ("attn", "mlp"):
        return Intervention(f"ablate_{what}", i, spec=spec)
    if what.startswith("h") and what[1:].isdigit():
        h = int(what[1:])
        if h >= bs[i].heads:
            raise InvalidParameter(f"ablate: head must be in 0..{bs[i].heads - 1}, got {spec!r}")
        return Intervention("ablate_head", i, head=h, spec=spec)
    raise InvalidParameter(f"ablate must be L.attn, L.mlp or L.hH, got {spec!r}")


def _layer(i: int, n: int, option: str, spec: str) -> int:
    if not 0 <= i < n:
        raise InvalidParameter(f"{option}: layer must be in 0..{n - 1}, got {spec!r}")
    return i


def checked_layer(model: Any, i: int, option: str, spec: str) -> int:
    """A decoder layer index of `model`, or one line naming the option and the spec."""
    return _layer(i, len(lens.unembedding(model).layers), option, spec)


def load_vector(path: str | Path) -> torch.Tensor:
    """A steering vector file: a tensor (hidden,) or a dict with "vector" (lmtrace steer-vector)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise InvalidParameter(f"steer: cannot read the vector file {str(path)!r} ({type(e).__name__})") from None
    vec = obj.get("vector") if isinstance(obj, dict) else obj
    if not isinstance(vec, torch.Tensor) or vec.dim() != 1:
        raise InvalidParameter(f"steer: {str(path)!r} holds no 1-d vector")
    return vec.float()


def parse_steer(spec: str, model: Any, vector: torch.Tensor | None = None) -> Intervention:
    """`L:FILE.pt:ALPHA` (or `L::ALPHA` with `vector` given), checked: the layer, the width."""
    parts = spec.split(":")
    if len(parts) < 3:
        raise InvalidParameter(f"steer must be L:FILE:ALPHA, got {spec!r}")
    layer, path, alpha = parts[0], ":".join(parts[1:-1]), parts[-1]
    try:
        a = float(alpha)
    except ValueError:
        raise InvalidParameter(f"steer: alpha must be a number, got {spec!r}") from None
    if not layer.isdigit():
        raise InvalidParameter(f"steer: layer must be a whole number, got {spec!r}")
    un = lens.unembedding(model)
    i = _layer(int(layer), len(un.layers), "steer", spec)
    vec = vector if vector is not None else load_vector(path)
    hidden = model.config.get_text_config().hidden_size
    if vec.shape != (hidden,):
        raise InvalidParameter(f"steer: the vector is {tuple(vec.shape)[0]} wide, the model's residual {hidden}, "
                               f"got {spec!r}")  # fmt: skip
    return Intervention("steer", i, vector=vec.float(), alpha=a, spec=spec)


def _replace(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def _hook(change: Intervention, model: Any) -> tuple[str, Any]:
    """(hook point, hook) for one change."""
    if change.kind in ("ablate_attn", "ablate_mlp"):
        point = f"blocks.{change.layer}.{'attn' if change.kind == 'ablate_attn' else 'mlp'}_out"

        def zero(m, args, output):
            h = output[0] if isinstance(output, tuple) else output
            return _replace(output, torch.zeros_like(h))

        return point, zero
    if change.kind == "ablate_head":
        b = attribution.blocks(model)[change.layer]

        def drop(m, args, kwargs):
            x = args[0] if args else kwargs["input"]
            width = x.shape[-1] // b.heads
            x = x.clone()
            x[..., change.head * width : (change.head + 1) * width] = 0  # (batch, seq, heads * head_dim)
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "input": x})

        return f"blocks.{change.layer}.attn.z", drop
    point = f"blocks.{change.layer}.resid_post"
    if change.kind == "patch":

        def patch(m, args, output):  # a forward from position 0 (prefill, full recompute) holds it
            h = output[0] if isinstance(output, tuple) else output
            if h.shape[1] <= change.position:
                return None  # a cached step: the patched position is in the cache already
            h = h.clone()
            h[:, change.position] = change.vector.to(h.device, h.dtype)  # (batch, seq, hidden)
            return _replace(output, h)

        return point, patch

    def steer(m, args, output):
        h = output[0] if isinstance(output, tuple) else output
        return _replace(output, h + change.alpha * change.vector.to(h.device, h.dtype))

    return point, steer


@contextmanager
def applied(model: Any, changes: Sequence[Intervention]) -> Iterator[None]:
    """Every change's hook on `model` for the duration (every forward: prefill, cached steps)."""
    with Hooks(model) as hooks:
        for change in changes:
            hooks.add(*_hook(change, model))
        yield
