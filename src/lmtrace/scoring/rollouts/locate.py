"""Where two computations part: the reference's and a variant's hidden states at one token's
position, layer by layer — the embedding, the residual stream after each decoder block, the
final norm, the lm_head's logits — as the relative difference ‖h_variant − h_ref‖ / ‖h_ref‖
(float32). The first layer whose difference exceeds the threshold, and the layer with the
largest jump (the largest rise over the layer before), say where they part."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lmtrace.inside import lens
from lmtrace.inside.hooks import Hooks
from lmtrace.model.lm import LM
from lmtrace.scoring.rollouts.options import check_locate
from lmtrace.scoring.rollouts.rollout import Rollout
from lmtrace.scoring.variants import worlds as variants
from lmtrace.scoring.variants.spec import VariantSpec


def points(model) -> list[tuple[str, str]]:
    """[(name, hook point)]: `embed`, `L0`..`L{n-1}` (the residual after each decoder block),
    `norm` (the final norm's output), `lm_head` (the logits)."""
    layers = len(lens.unembedding(model).layers)
    out = [("embed", "embed")]
    out += [(f"L{i}", f"blocks.{i}.resid_post") for i in range(layers)]
    out += [("norm", "norm.out"), ("lm_head", "unembed")]
    return out


@contextlib.contextmanager
def captured(model) -> Iterator[dict[str, torch.Tensor]]:
    """Each point's output at the last position, float32 (hidden,) or (vocab,), while inside."""
    seen: dict[str, torch.Tensor] = {}
    with Hooks(model) as hooks:
        for name, point in points(model):

            def hook(_m, _args, output, name=name):
                h = output[0] if isinstance(output, tuple) else output
                seen[name] = h[0, -1].detach().float().clone()  # (1, seq, dim) -> (dim,)

            hooks.add(point, hook)
        yield seen


def hidden(model, ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Every module's output at the last position of one uncached forward of `ids`."""
    with torch.inference_mode(), captured(model) as seen:
        model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=False, logits_to_keep=1)
    return dict(seen)


def compare(reference: dict[str, torch.Tensor], variant: dict[str, torch.Tensor], threshold: float) -> dict[str, Any]:
    """The per-layer relative differences, the first over `threshold`, the largest jump."""
    layers, before, first, jump = [], 0.0, None, None
    for name, ref in reference.items():
        rel = float((variant[name].to(ref.device) - ref).norm() / ref.norm().clamp_min(1e-30))
        layers.append({"layer": name, "relative": rel})
        if first is None and rel > threshold:
            first = name
        if jump is None or rel - before > jump["jump"]:
            jump = {"layer": name, "jump": rel - before}
        before = rel
    return {"threshold": threshold, "layers": layers, "first_over": first, "largest_jump": jump}


def in_world(world: variants.World, ids: Sequence[int]) -> dict[str, torch.Tensor]:
    with world.scope():
        return hidden(world.lm.model, ids)


def locate_at(lm: LM, rollout: Rollout, index: int, spec: VariantSpec, threshold: float = 0.01) -> dict[str, Any]:
    """Reference against `spec` at the position that predicts completion token `index`."""
    check_locate(spec)
    ids = rollout.prompt_ids + rollout.completion_ids[:index]
    reference = hidden(lm.model, ids)
    world = variants.build(lm, spec)
    try:
        other = in_world(world, ids)
    finally:
        world.close()
    return {
        "variant": spec.spec,
        "rollout": rollout.id,
        "index": index,
        "token_id": rollout.completion_ids[index],
        "position": len(ids) - 1,
        **compare(reference, other, threshold),
    }


def locate_worst(
    lm: LM, rollouts: Sequence[Rollout], rows: Sequence[dict[str, Any]], spec: VariantSpec, threshold: float
) -> dict[str, Any]:
    """locate_at the token with the largest |trainer − engine| among the flagged ones (among
    all, where none is flagged)."""
    best, key = None, None
    for k, row in enumerate(rows):
        for t in row["tokens"]:
            t_lp = t["trainer_logprob"]
            gap = math.inf if t_lp is None else abs(t["engine_logprob"] - t_lp)
            score = (t["flagged"], gap)
            if key is None or score > key:
                best, key = (k, t["index"]), score
    out = locate_at(lm, rollouts[best[0]], best[1], spec, threshold)
    out["flagged"] = bool(key[0])
    return out
