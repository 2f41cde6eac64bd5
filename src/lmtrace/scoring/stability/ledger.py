"""`lmtrace.stability(lm, prompt, variants=[...])`: will this token flip? The reference is
decoded once; then under each variant (another dtype, packed weights, another attention
kernel, a batch, a thread count, torch.compile, vLLM, another file of the model) the reference's
tokens are teacher-forced (each step's logprob, its delta, whether the variant's top-1 differs)
and the prompt is decoded freely (greedy, or the same seed) to find the first step whose token
differs. Per step the margin (top-1 minus top-2 raw logprob) is set against the noise the
variants show there (lmtrace.scoring.stability.noise)."""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace import arguments
from lmtrace.decode.row_state import make_params, seeded
from lmtrace.decode.tracing import generate
from lmtrace.errors import GenerationError, InvalidParameter, ModelLoadError
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams, check_integer
from lmtrace.records import Trace
from lmtrace.scoring.stability import noise
from lmtrace.scoring.variants.spec import DEFAULT, VariantSpec, parse_variants
from lmtrace.scoring.variants.worlds import World, build

# what a variant that cannot run here raises: it is reported skipped, with the reason
CANNOT_RUN = (
    InvalidParameter,
    ModelLoadError,
    GenerationError,
    RuntimeError,
    NotImplementedError,
    ImportError,
    OSError,
)


@dataclass(frozen=True)
class StabilityOptions:
    """What `stability` takes besides the prompt, the variants and the sampling settings: `runs`
    decodes the reference that many times in all; `threshold`: a step is flagged when its margin
    is below threshold x sigma; `chat` applies the chat template; `params` a SamplingParams the
    sampling keywords are laid over; `on_status(line)` hears what runs now."""

    runs: int = 1
    threshold: float = noise.THRESHOLD
    chat: bool = False
    params: SamplingParams | None = None
    on_status: Callable[[str], None] | None = None


@dataclass
class StabilityResult:
    """The reference trace, one dict per variant, the per-step ledger and the repeated runs."""

    reference: Trace
    variants: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    threshold: float
    runs: list[dict[str, Any]] = field(default_factory=list)
    timing: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "stability",
            "reference": self.reference.to_dict(),
            "variants": self.variants,
            "steps": self.steps,
            "threshold": self.threshold,
            "noise": "sigma: the largest over the variants that ran of max(|change of the reference's top-1/top-2 gap| "
            "at the step, the root-mean-square of the variant's changes over the steps)",
            "runs": self.runs,
            "timing": self.timing,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(_finite(self.to_dict()), ensure_ascii=False, allow_nan=False, indent=indent)

    def variant(self, spec: str) -> dict[str, Any]:
        for v in self.variants:
            if v["variant"] == spec:
                return v
        raise KeyError(spec)

    @property
    def flagged(self) -> list[int]:
        return [s["index"] for s in self.steps if s["flagged"]]


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first step whose token differs (where one run stops before the other: the step
    where it stopped); None when both are the same tokens."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@dataclass
class Reference:
    """What every variant is compared with: the trace, its prompt ids and its forced baseline."""

    trace: Trace
    ids: list[int]
    base: torch.Tensor  # (steps, vocab) raw log-probs of the reference model, teacher-forced
    top1: list[int]
    top2: list[int]

    @property
    def tokens(self) -> list[int]:
        return list(self.trace.token_ids)


def reference_of(lm: LM, trace: Trace) -> Reference:
    """A decoded trace with its teacher-forced baseline (the same plain forward the variants use)."""
    ids = list(trace.prompt["token_ids"])
    base = World(lm).forced(ids + list(trace.token_ids), len(ids))
    top1 = [s.top[0].token_id for s in trace.steps]
    top2 = [s.top[1].token_id for s in trace.steps]
    return Reference(trace, ids, base, top1, top2)


def forced_steps(ref: Reference, lp: torch.Tensor) -> list[dict[str, Any]]:
    """One variant's per-step numbers from its teacher-forced log-probs `lp` (steps, vocab)."""
    t = torch.tensor(ref.tokens)[:, None]  # (steps, 1)
    a, b = torch.tensor(ref.top1)[:, None], torch.tensor(ref.top2)[:, None]
    lp, base = lp.float().cpu(), ref.base.float().cpu()
    change = (lp.gather(-1, a) - lp.gather(-1, b)) - (base.gather(-1, a) - base.gather(-1, b))
    return noise.variant_steps(
        lp.gather(-1, t)[:, 0].tolist(),
        base.gather(-1, t)[:, 0].tolist(),
        lp.argmax(-1).tolist(),
        ref.top1,
        change[:, 0].tolist(),
    )


def run_variant(world: World, ref: Reference, params: SamplingParams, chat: bool) -> dict[str, Any]:
    """A variant's record: its forced steps, their summary, its own decode and where it diverges."""
    started = time.perf_counter()
    steps = forced_steps(ref, world.forced(ref.ids + ref.tokens, len(ref.ids)))
    forced_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    tokens = world.decode(ref.trace.prompt["text"], ref.ids, params, chat)
    return {
        "variant": world.spec.spec,
        "status": "ran",
        "reason": None,
        "about": world.about,
        "first_divergence": first_divergence(ref.tokens, tokens),
        "token_ids": tokens,
        "text": world.lm.tokenizer.decode(tokens),
        **noise.variant_summary(steps),
        "steps": steps,
        "timing": {"forced_ms": forced_ms, "decode_ms": (time.perf_counter() - started) * 1000},
    }


def skipped(spec: VariantSpec, reason: str) -> dict[str, Any]:
    """The record of a variant that could not run here."""
    return {
        "variant": spec.spec,
        "status": "skipped",
        "reason": reason,
        "about": None,
        "first_divergence": None,
        "token_ids": None,
        "text": None,
        "max_abs_delta": None,
        "mean_abs_delta": None,
        "flips": None,
        "first_flip": None,
        "steps": [],
        "timing": {},
    }


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())[:300]
    return text if isinstance(e, InvalidParameter | ModelLoadError) else f"{type(e).__name__}: {text}"


def each_variant(
    lm: LM, specs: list[VariantSpec], ref: Reference, params: SamplingParams, chat: bool, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Builds, runs and frees one variant at a time (only one copy of the model is held)."""
    out = []
    for spec in specs:
        say(f"variant {spec.spec}")
        world = None
        try:
            started = time.perf_counter()
            world = build(lm, spec)
            build_ms = (time.perf_counter() - started) * 1000
            record = run_variant(world, ref, params, chat)
            record["timing"]["build_ms"] = build_ms
        except CANNOT_RUN as e:
            record = skipped(spec, one_line(e))
        finally:
            if world is not None:
                world.close()
            gc.collect()
        out.append(record)
    return out


def repeat_runs(lm: LM, ref: Reference, prompt: str, params: SamplingParams, chat: bool, runs: int) -> list[dict]:
    """The reference decoded again `runs - 1` times: run-to-run determinism on this machine."""
    out = []
    for run in range(1, runs):
        again = generate(lm, prompt, params, chat=chat)
        deltas = [abs(a.logprob - b.logprob) for a, b in zip(ref.trace.steps, again.steps)]
        out.append(
            {
                "run": run,
                "first_divergence": first_divergence(ref.tokens, again.token_ids),
                "max_abs_delta": max(deltas, default=0.0),
                "identical": again.token_ids == ref.tokens and not any(deltas),
            }
        )
    return out


def stability(
    lm: LM,
    prompt: str,
    variants: Sequence[str | VariantSpec] = DEFAULT,
    options: StabilityOptions | None = None,
    **keywords: Any,
) -> StabilityResult:
    """Decodes `prompt` (sampling: max_new_tokens, temperature, seed, ...; or `params`), then
    measures it under each variant spec (lmtrace.scoring.variants.spec; a variant that cannot run
    here is reported skipped, with the reason). `options` (StabilityOptions: runs, threshold,
    chat, params, on_status), or its fields as keywords; the other keywords are sampling settings.
    `runs` decodes the reference that many times in
    all; `threshold`: a step is flagged when its margin is below threshold x sigma;
    `on_status(line)` hears what runs now."""
    own, sampling = arguments.split(StabilityOptions, keywords)
    o = arguments.options(StabilityOptions, options, "stability", own)
    runs, threshold, chat = o.runs, o.threshold, o.chat
    specs = parse_variants([variants] if isinstance(variants, str | VariantSpec) else list(variants))
    check_integer("runs", runs, low=1)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold < math.inf:
        raise InvalidParameter(f"threshold must be a number > 0, got {threshold!r}")
    p = seeded(make_params(o.params, "stability", **sampling))
    p = make_params(p, top_logprobs=max(2, p.top_logprobs))  # the margin needs the runner-up
    say = o.on_status or (lambda line: None)
    say("reference")
    started = time.perf_counter()
    trace = generate(lm, prompt, p, chat=chat)
    reference_ms = (time.perf_counter() - started) * 1000
    ref = reference_of(lm, trace)
    records = each_variant(lm, specs, ref, p, chat, say)
    ran = [v for v in records if v["status"] == "ran"]
    sigma = noise.sigma([[s["margin_change"] for s in v["steps"]] for v in ran])
    margins = [s.top[0].logprob - s.top[1].logprob for s in trace.steps]
    steps = noise.ledger(margins, sigma, threshold)
    for row, s in zip(steps, trace.steps):
        row.update(
            token_id=s.token_id,
            text=s.text,
            runner_up_id=s.top[1].token_id,
            runner_up=s.top[1].text,
            flipped_in=[v["variant"] for v in ran if v["steps"][row["index"]]["flipped"]],
        )
    repeats = repeat_runs(lm, ref, prompt, p, chat, runs)
    return StabilityResult(trace, records, steps, float(threshold), repeats, {"reference_ms": reference_ms})
