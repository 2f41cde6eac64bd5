"""`lmtrace.kvlab(lm, prompt, policies=[...], **sampling)`: one reference run with the full
cache, and for each policy an arm fed the reference's tokens at the same positions.

The reference is a generated Trace (`lmtrace.generate`), or with `continuation` a given text
teacher-forced after the prompt (a Trace built from the full-cache replay's own numbers)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace import arguments
from lmtrace.detokenize import IncrementalDetokenizer, TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger
from lmtrace.kvlab import metrics, runner
from lmtrace.kvlab.policies.base import Policy
from lmtrace.kvlab.spec import parse_policies
from lmtrace.logits import measure
from lmtrace.model.lm import LM
from lmtrace.records import Step, Trace
from lmtrace.records.alternatives import alternatives
from lmtrace.records.steps import StepNumbers, new_step
from lmtrace.records.timing import timing
from lmtrace.records.traces import new_trace
from lmtrace.stops import finish_reason


def _finite(x: Any) -> Any:
    """JSON has no infinities or NaN: they become null, as in the trace JSON."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


@dataclass(frozen=True)
class LabOptions:
    """What kvlab takes besides the prompt, the policies and the reference's generate options.
    `continuation`: that text is the reference, teacher-forced (its first
    `max_continuation_tokens` tokens where given). `map_step` (default: the last step) is where
    each arm's kept positions are recorded for the layer x position map; `free` lets each arm
    generate alone from its divergence step; `on_step(index, total)` is called after each step."""

    continuation: str | None = None
    max_continuation_tokens: int | None = None
    free: bool = False
    map_step: int | None = None
    on_step: Callable[[int, int], None] | None = None


@dataclass
class LabResult:
    """The reference trace and one dict per arm: {policy, steps, summary, kept_map, free}."""

    reference: Trace
    arms: list[dict[str, Any]]
    prompt_tokens: int
    teacher_forced: bool
    map_step: int | None
    reference_bytes: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "kvlab",
            "reference": self.reference.to_dict(),
            "arms": self.arms,
            "prompt_tokens": self.prompt_tokens,
            "teacher_forced": self.teacher_forced,
            "map_step": self.map_step,
            "reference_bytes": self.reference_bytes,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(_finite(self.to_dict()), ensure_ascii=False, allow_nan=False, indent=indent)

    def arm(self, spec: str) -> dict[str, Any]:
        for a in self.arms:
            if a["policy"] == spec or a["policy"].split(":")[0] == spec:
                return a
        raise KeyError(spec)


def _reference_steps(lm: LM, tokens: list[int], top_n: int) -> tuple[list[Step], Callable]:
    """Steps of a teacher-forced continuation, filled in from the replay as it runs (a forced
    token's numbers are the same under the raw and the processed distribution: none is processed)."""
    steps: list[Step] = []
    detok, tb = IncrementalDetokenizer(lm.tokenizer), TokenBytes(lm.tokenizer)

    def on_step(index: int, ref: runner.Arm, lp: torch.Tensor) -> None:
        token = tokens[index]
        chosen = float(lp[token])
        entropy = float(measure.entropy(lp[None])[0])
        numbers = StepNumbers(chosen, chosen, int(measure.rank(lp, lp[token : token + 1])), entropy, entropy)
        top_lp, top_ids = torch.topk(lp, top_n) if top_n else (lp[:0], lp[:0].long())
        top = alternatives(top_ids.tolist(), top_lp.tolist(), top_lp.tolist(), tb)
        piece = detok.add(token, final=index == len(tokens) - 1)
        kv = ledger.state(ref.lab.cache).to_dict()
        steps.append(new_step(index, token, piece, numbers, top, tb, kv=kv, time_ms=0.0))

    return steps, on_step


@dataclass
class Forced:
    """A teacher-forced continuation: its text, its token ids and the steps the replay measured."""

    text: str
    tokens: list[int]
    steps: list[Step]


def _forced_trace(lm: LM, prompt: str, ids: list[int], forced: Forced, params: dict[str, Any], ms: float) -> Trace:
    return new_trace(
        forced.steps,
        text=forced.text,
        finish_reason=finish_reason(False, False, True, openai=True),  # forced: as long as the text
        stop_reason=None,
        model=lm.record(),
        params={**params, "teacher_forced": True},
        prompt={"text": prompt, "token_ids": ids},
        timing=timing(None, len(ids), len(forced.tokens), total_ms=ms),
    )


def _arm_dict(arm: runner.Arm, ref: runner.Arm, free: list[int] | None, lm: LM) -> dict[str, Any]:
    d: dict[str, Any] = {
        "policy": arm.policy.spec,
        "about": arm.policy.about,
        "steps": arm.steps,
        "summary": metrics.summary(arm.steps, [s["bytes"] for s in ref.steps], arm.divergence),
        "kept_map": arm.kept_map,
    }
    if free is not None:
        d["free"] = {"divergence_step": arm.divergence, "token_ids": free, "text": lm.tokenizer.decode(free)}
    return d


def _continuation(lm: LM, text: str, limit: int | None) -> tuple[list[int], str]:
    """The reference tokens of a given continuation (its first `limit` where given) and its text."""
    tokens = list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    if limit is not None:
        tokens = tokens[:limit]
        text = lm.tokenizer.decode(tokens)
    if not tokens:
        raise InvalidParameter("continuation: the text has no tokens")
    return tokens, text


# what a generation records or changes beside its numbers: none of it has a run to come from
# when the reference is a teacher-forced continuation
GENERATED_ONLY = (
    "echo",
    "waterfall",
    "compile",
    "lens",
    "attention",
    "draft",
    "observers",
    "logits_processors",
    "uncertainty",
    "attribution",
)


def _forced_alone(options: Any) -> None:
    """A teacher-forced continuation is the replay's own numbers: an option of a generation or a
    constraint beside it is refused in one line naming both."""
    from lmtrace.decode.options import GenerateOptions

    plain = GenerateOptions(options.params, chat=options.chat)
    given = [name for name in GENERATED_ONLY if getattr(options, name) != getattr(plain, name)]
    if options.params.constraint is not None:
        given.append(options.params.constraint)
    if given:
        name = given[0]
        raise InvalidParameter(
            f"continuation and {name}: a teacher-forced continuation is neither generated nor constrained; "
            f"drop {name} or the continuation"
        )


def _rule(lm: LM, options: Any) -> runner.Rule:
    """The reference's rule for every arm's own choice: its params, a fresh grammar matcher (moved
    past the reference's tokens as they go in), the user's processors."""
    from lmtrace.decode import constrained
    from lmtrace.logits.processors import user_processors

    found = constrained.matchers(lm, [options.params])
    matcher = found[0] if found else None
    return runner.Rule(options.params, matcher, user_processors(options.logits_processors))


def kvlab(
    lm: LM,
    prompt: str,
    policies: Sequence[str | Policy] = ("full",),
    options: LabOptions | None = None,
    params: Any = None,
    **keywords: Any,
) -> LabResult:
    """Runs the reference and one arm per policy spec (see `lmtrace.kvlab.spec`). `options`
    (LabOptions), or its fields as keywords: `continuation`, `max_continuation_tokens`, `free`,
    `map_step`, `on_step`. The other keywords go to the reference's generation: the sampling
    settings (max_new_tokens, temperature, seed,
    a constraint, ...) and generate's options (chat, lens, attention, echo, waterfall, draft, compile,
    logits_processors, uncertainty, attribution), so the reference is `lmtrace.generate`'s trace;
    each arm's own choice follows the reference's rule (its processors, penalty and grammar, moved
    past the reference's tokens). With
    `continuation`, that text is the reference, teacher-forced (its first `max_continuation_tokens`
    tokens where given). `map_step` (default: the last step) is where each arm's kept positions
    are recorded for the layer x position map; `free` lets each arm generate alone from its
    divergence step; `on_step(index, total)` is called after each step; `params` a SamplingParams."""
    from lmtrace.decode.options import GenerateOptions
    from lmtrace.decode.row_state import seeded
    from lmtrace.decode.tracing import encode_prompt, generate

    own, sampling = arguments.split(LabOptions, keywords)
    lab = arguments.options(LabOptions, options, "kv-lab", own)
    continuation, map_step, on_step = lab.continuation, lab.map_step, lab.on_step
    chosen = parse_policies(list(policies))
    asked = GenerateOptions.of(params, "kv-lab", **sampling)
    asked = dataclasses.replace(asked, params=seeded(asked.params))
    params, chat = asked.params, asked.chat
    ids = encode_prompt(lm, prompt, chat)
    started = time.perf_counter()
    if continuation is not None:
        _forced_alone(asked)
        tokens, continuation = _continuation(lm, continuation, lab.max_continuation_tokens)
        steps, build = _reference_steps(lm, tokens, params.top_logprobs)
    else:
        trace = generate(lm, prompt, options=asked)
        tokens, build = list(trace.token_ids), None
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if limit and len(ids) + len(tokens) > limit:
        raise InvalidParameter(f"continuation: prompt {len(ids)} + {len(tokens)} tokens > {limit} positions")
    last = len(tokens) - 1 if map_step is None else map_step
    if not 0 <= last < len(tokens):
        raise InvalidParameter(f"map_step must be a step in 0..{len(tokens) - 1}, got {map_step}")

    def each(index: int, ref: runner.Arm, lp: torch.Tensor) -> None:
        if build is not None:
            build(index, ref, lp)
        if on_step is not None:
            on_step(index, len(tokens))

    ref, arms = runner.lockstep(lm.model, ids, tokens, chosen, _rule(lm, asked), lab.free, last, each)
    if continuation is not None:
        forced, settings = Forced(continuation, tokens, steps), {**params.to_dict(), "chat": chat}
        trace = _forced_trace(lm, prompt, ids, forced, settings, (time.perf_counter() - started) * 1000)
    frees = [runner.run_free(lm.model, a, ids, tokens, lm.eos_token_ids) if lab.free else None for a in arms]
    return LabResult(
        reference=trace,
        arms=[_arm_dict(a, ref, f, lm) for a, f in zip(arms, frees)],
        prompt_tokens=len(ids),
        teacher_forced=continuation is not None,
        map_step=last,
        reference_bytes=[s["bytes"] for s in ref.steps],
    )
