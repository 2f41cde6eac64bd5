"""`lmtrace.intervene(lm, prompt, ablate=[...], steer=[...])`: the reference generation and one
arm per intervention, side by side as kv-lab's arms are.

Each arm is measured twice. Teacher-forced: one forward over the prompt and the reference's
tokens with the intervention's hooks on, against the same forward without them — per step the
reference token's logprob under the arm, its change (Δ), KL(reference ‖ arm) and whether the
arm's top-1 is the reference token. Free-running: the arm generates alone through
`lmtrace.generate` (the cached loop, the hooks on for the prefill and every step) with the
reference's sampling settings and seed; the first step whose token differs is the divergence."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace import arguments
from lmtrace.decode.row_state import make_params, seeded
from lmtrace.decode.tracing import encode_prompt, generate
from lmtrace.errors import InvalidParameter
from lmtrace.inside import intervene as hooks
from lmtrace.interventions.vectors import last_residual
from lmtrace.model.lm import LM
from lmtrace.records import Trace


@dataclass(frozen=True)
class InterveneOptions:
    """How `intervene` decodes besides the interventions and the sampling settings: `chat` applies
    the chat template, `free` lets each arm generate alone too, `params` a SamplingParams the
    sampling keywords are laid over."""

    chat: bool = False
    free: bool = True
    params: Any = None


@dataclass
class InterventionResult:
    """The reference trace and one dict per arm: {intervention, steps, summary, free}."""

    reference: Trace
    arms: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "intervene", "reference": self.reference.to_dict(), "arms": self.arms}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False, indent=indent)

    def arm(self, spec: str) -> dict[str, Any]:
        return next(a for a in self.arms if a["intervention"] == spec)


def forced_logits(
    lm: LM, ids: list[int], tokens: list[int], changes: Sequence[hooks.Intervention] = ()
) -> torch.Tensor:
    """float32 logits (len(tokens), vocab) predicting each of `tokens` after `ids`: one full
    forward (no cache) with the changes' hooks on."""
    seq = torch.tensor([ids + tokens], device=lm.model.device)  # (1, prompt + tokens)
    with torch.inference_mode(), hooks.applied(lm.model, changes):
        out = lm.model(input_ids=seq).logits[0, len(ids) - 1 : -1]  # (tokens, vocab)
    return out.float()


def step_numbers(ref: torch.Tensor, arm: torch.Tensor, tokens: list[int]) -> list[dict[str, Any]]:
    """Per step {index, token_id, logprob, delta, kl, top1_agree} of the arm's logits (T, vocab)
    against the reference's (T, vocab), on the reference tokens (T,)."""
    ref_lp, arm_lp = torch.log_softmax(ref, -1), torch.log_softmax(arm, -1)
    idx = torch.tensor(tokens, device=ref.device)[:, None]
    chosen, ref_chosen = arm_lp.gather(-1, idx)[:, 0], ref_lp.gather(-1, idx)[:, 0]
    kl = (ref_lp.exp() * (ref_lp - arm_lp)).sum(-1).clamp(min=0.0)  # KL(reference ‖ arm), nats
    agree = (arm_lp.argmax(-1) == idx[:, 0]).tolist()
    rows = zip(chosen.tolist(), (chosen - ref_chosen).tolist(), kl.tolist(), agree)
    return [
        {"index": i, "token_id": t, "logprob": lp, "delta": d, "kl": k, "top1_agree": bool(a)}
        for i, (t, (lp, d, k, a)) in enumerate(zip(tokens, rows))
    ]


def summary(steps: list[dict[str, Any]], divergence: int | None) -> dict[str, Any]:
    n = len(steps)
    if n == 0:
        return {
            "mean_kl": None,
            "max_kl": None,
            "top1_agreement": None,
            "mean_delta": None,
            "divergence_step": divergence,
        }
    kls = [s["kl"] for s in steps]
    return {
        "mean_kl": sum(kls) / n,
        "max_kl": max(kls),
        "top1_agreement": sum(s["top1_agree"] for s in steps) / n,
        "mean_delta": sum(s["delta"] for s in steps) / n,
        "divergence_step": divergence,
    }


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def parse_patch(lm: LM, spec: str, prompt_ids: list[int]) -> hooks.Intervention:
    """`L:TEXT`: the residual after layer L at the prompt's last position replaced by TEXT's
    residual after layer L at its own last position."""
    layer, sep, text = spec.partition(":")
    if not sep or not layer.isdigit() or not text:
        raise InvalidParameter(f"patch must be L:TEXT, got {spec!r}")
    vector = last_residual(lm, text, hooks.checked_layer(lm.model, int(layer), "patch", spec))
    return hooks.Intervention("patch", int(layer), vector=vector, spec=spec, position=len(prompt_ids) - 1)


def changes_for(
    lm: LM,
    ablate: Sequence[str] = (),
    steer: Sequence[str | tuple] = (),
    patch: Sequence[str] = (),
    prompt_ids: list[int] | None = None,
) -> list[hooks.Intervention]:
    """The arms' interventions, checked against the model; a steer is a spec `L:FILE:ALPHA` or
    (layer, vector, alpha), a patch `L:TEXT` (at the last of `prompt_ids`)."""
    out = [hooks.parse_ablate(s, lm.model) for s in ablate]
    for s in steer:
        if isinstance(s, tuple):
            layer, vector, alpha = s
            change = hooks.parse_steer(f"{layer}::{alpha}", lm.model, torch.as_tensor(vector))
            change.spec = f"{layer}:vector:{alpha}"  # a vector given in Python: no file to name
            out.append(change)
        else:
            out.append(hooks.parse_steer(s, lm.model))
    out += [parse_patch(lm, s, list(prompt_ids or [])) for s in patch]
    if not out:
        raise InvalidParameter("intervene: needs at least one --ablate, --steer or --patch, got none")
    return out


def intervene(
    lm: LM,
    prompt: str,
    ablate: Sequence[str] = (),
    steer: Sequence[str | tuple] = (),
    patch: Sequence[str] = (),
    options: InterveneOptions | None = None,
    **keywords: Any,
) -> InterventionResult:
    """The reference generation and one arm per intervention (each alone): `ablate` specs
    `L.attn`, `L.mlp`, `L.hH`; `steer` specs `L:FILE.pt:ALPHA` or (layer, vector, alpha).
    `options` (InterveneOptions: chat, free, params), or its fields as keywords; the other
    keywords are sampling settings (max_new_tokens, temperature, seed, ...) laid over `params`:
    they set the reference's decoding,
    which each free-running arm repeats with the same seed. `patch` specs `L:TEXT`: the residual
    after layer L at the prompt's last position set to TEXT's there (activation patching)."""
    own, sampling = arguments.split(InterveneOptions, keywords)
    o = arguments.options(InterveneOptions, options, "intervene", own)
    chat = o.chat
    ids = encode_prompt(lm, prompt, chat)
    changes = changes_for(lm, ablate, steer, patch, ids)
    p = seeded(make_params(o.params, "intervene", **sampling))
    reference = generate(lm, prompt, p, chat=chat)
    tokens = list(reference.token_ids)
    ref_logits = forced_logits(lm, ids, tokens) if tokens else None
    arms = []
    for change in changes:
        steps = step_numbers(ref_logits, forced_logits(lm, ids, tokens, [change]), tokens) if tokens else []
        arm: dict[str, Any] = {"intervention": change.spec, "kind": change.kind, "steps": steps}
        divergence = None
        if o.free:
            with hooks.applied(lm.model, [change]):
                alone = generate(lm, prompt, p, chat=chat)
            divergence = _first_divergence(tokens, list(alone.token_ids))
            arm["free"] = {"text": alone.text, "token_ids": list(alone.token_ids), "first_divergence": divergence}
        arm["summary"] = summary(steps, divergence)
        arms.append(_finite(arm))
    return InterventionResult(reference, arms)


def _finite(x: Any) -> Any:
    """JSON has no infinities or NaN: they become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x
