"""The causes that need the model again, for the rollouts the first checks left unexplained:
the prompt as its own text tokenizes (`retokenized`), then the stability variants (`numeric`
names the one that fits best; none fits: `weights`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from lmtrace.errors import InvalidParameter
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.scoring.rollouts import causes, computed
from lmtrace.scoring.rollouts.rollout import Rollout
from lmtrace.scoring.variants import worlds as variants
from lmtrace.scoring.variants.spec import VariantSpec, parse_variant

NUMERIC = ("dtype:bfloat16", "dtype:float16")  # the variants tried for numeric noise, beside --trainer's


def canonical(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """The ids of the text that `ids` spell, as the tokenizer splits that text itself."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def retokenized(
    lm: LM,
    rollouts: Sequence[Rollout],
    todo: Sequence[int],
    params: Sequence[SamplingParams],
    aligned: dict[int, float],
) -> dict[int, dict[str, Any]]:
    """i -> a `retokenized` cause for the rollouts whose engine logprobs fit once the prompt is
    re-tokenized from its text (the engine saw the text's own tokens, the record keeps others)."""
    others: dict[int, Rollout] = {}
    for i in todo:
        ids = canonical(lm.tokenizer, rollouts[i].prompt_ids)
        if ids and ids != rollouts[i].prompt_ids:
            others[i] = replace(rollouts[i], prompt_ids=ids)
    if not others:
        return {}
    order = list(others)
    values = computed.processed(lm, [others[i] for i in order], [params[i] for i in order])
    out = {}
    for i, v in zip(order, values):
        got = causes.fit(rollouts[i].logprobs, v)
        if got <= causes.FIT * aligned[i]:
            old, new = rollouts[i].prompt_ids, others[i].prompt_ids
            same = sum(1 for a, b in zip(old, new) if a == b)
            first = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
            out[i] = causes.cause(
                "retokenized",
                "prompt",
                {
                    "aligned_fit": aligned[i],
                    "retokenized_fit": got,
                    "prompt_ids": len(old),
                    "text_ids": len(new),
                    "ids_matching": same / max(len(old), len(new)),
                    "first_difference": first,
                },
            )
    return out


def candidate_specs(lm: LM, trainer: VariantSpec | None) -> list[VariantSpec]:
    """The variants tried for numeric noise: NUMERIC (less the reference's own dtype) and --trainer's."""
    own = lm.summary.dtype
    specs = [parse_variant(s) for s in NUMERIC if s.split(":")[1] != own]
    if trainer is not None and trainer.spec not in {s.spec for s in specs}:
        specs.append(trainer)
    return specs


def variant_fits(
    lm: LM,
    rollouts: Sequence[Rollout],
    todo: Sequence[int],
    params: Sequence[SamplingParams],
    specs: Sequence[VariantSpec],
    reference: Sequence[list[float]],
    on_status: Callable[[str], None] | None = None,
) -> tuple[dict[int, dict[str, dict[str, float]]], list[dict[str, str]]]:
    """(i -> {variant spec: {fit, noise}}, [{variant, reason}] of the variants that cannot run
    here): `fit` the engine against the variant's processed logprobs, `noise` the variant
    against the reference's own (how far that variant moves the numbers)."""
    fits: dict[int, dict[str, dict[str, float]]] = {i: {} for i in todo}
    skipped = []
    subset = [rollouts[i] for i in todo]
    for spec in specs:
        if on_status is not None:
            on_status(spec.spec)
        try:
            world = variants.build(lm, spec)
        except (InvalidParameter, ImportError, RuntimeError, ValueError) as e:
            skipped.append({"variant": spec.spec, "reason": " ".join(str(e).split())[:200]})
            continue
        try:
            values = computed.processed(lm, subset, [params[i] for i in todo], world)
        finally:
            world.close()
        for i, v in zip(todo, values):
            fits[i][spec.spec] = {"fit": causes.fit(rollouts[i].logprobs, v), "noise": causes.fit(reference[i], v)}
    return fits, skipped
