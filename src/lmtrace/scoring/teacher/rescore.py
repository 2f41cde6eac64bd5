"""The round trip: rescore a generated trace teacher-forced (one uncached forward pass over
prompt + generated tokens) and compare with the numbers recorded during cached decoding.

A cached loop that uses the cache right gives the same numbers up to float rounding; a wrong
position, mask or cache entry shows up as a large difference at the first step it touches."""

from __future__ import annotations

import math
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.logits import measure, sampling
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Trace
from lmtrace.scoring.teacher.score import forward_windows, resolve_window


def _diff(recorded: float | None, rescored: float) -> float | None:
    if recorded is None:  # a distribution the trace does not hold (from_generate with one of the two)
        return None
    if math.isinf(recorded) and math.isinf(rescored) and recorded == rescored:
        return 0.0  # both filtered by the processors (a forced branch token can be)
    return abs(recorded - rescored)


def _worst(diffs: list[float | None]) -> tuple[float | None, int | None]:
    known = [(d, i) for i, d in enumerate(diffs) if d is not None]
    if not known:
        return None, None
    return max(known, key=lambda x: x[0])


def _seen_masks(prompt_ids: list[int], generated: list[int], vocab: int) -> torch.Tensor:
    """(steps, vocab): the tokens in the sequence before each step (the repetition penalty's view)."""
    seen = torch.zeros((len(generated), vocab), dtype=torch.bool)
    seen[:, prompt_ids] = True
    for i in range(1, len(generated)):
        seen[i] = seen[i - 1]
        seen[i, generated[i - 1]] = True
    return seen


def rescore(lm: LM, trace: Trace) -> dict[str, Any]:
    """Largest differences between the trace's recorded numbers and a teacher-forced rescoring:
    `max_abs_diff` (raw logprob), `max_abs_diff_sampled` (the processors re-applied to the
    rescored logits), each with the step where it occurs; `rank_mismatches`; with an echoed
    prompt also `max_abs_diff_prompt`; and the rescored `logprobs` / `sampled_logprobs`."""
    prompt_ids = list(trace.prompt["token_ids"])
    generated = [s.token_id for s in trace.steps]
    if not prompt_ids or not generated:
        raise InvalidParameter(f"trace must hold a prompt and at least one step, got {len(generated)} steps")
    params = SamplingParams.from_dict(trace.params)
    # the processors can be re-applied only where the trace knows them: not for a model.generate
    # run whose settings were not given, nor for beam search (its scores are log-probabilities)
    redo = "temperature" in trace.params and "num_beams" not in trace.params
    ids = prompt_ids + generated
    with torch.inference_mode():
        windows = forward_windows(lm.model, ids, 1, *resolve_window(lm.model, None, None))
        logits = torch.cat([rows.float() for _, rows in windows])  # (len(ids) - 1, vocab): row i predicts ids[i + 1]
        steps = logits[len(prompt_ids) - 1 :]  # (generated, vocab)
        target = torch.tensor(generated, device=steps.device)[:, None]
        raw = torch.log_softmax(steps, -1)
        seen = _seen_masks(prompt_ids, generated, steps.shape[-1]).to(steps.device)
        used = torch.log_softmax(sampling.process_logits(steps, params, seen), -1)
        lp, slp = raw.gather(-1, target)[:, 0].tolist(), used.gather(-1, target)[:, 0].tolist()
        ranks = measure.rank(raw, raw.gather(-1, target)).tolist()
        prompt_lp = torch.log_softmax(logits[: len(prompt_ids) - 1], -1)
        prompt_lp = prompt_lp.gather(-1, torch.tensor(prompt_ids[1:], device=steps.device)[:, None])[:, 0].tolist()
    diff, step = _worst([_diff(s.logprob, x) for s, x in zip(trace.steps, lp)])
    sdiff, sstep = _worst([_diff(s.sampled_logprob, x) if redo else None for s, x in zip(trace.steps, slp)])
    out: dict[str, Any] = {
        "steps": len(generated),
        "max_abs_diff": diff,
        "worst_step": step,
        "max_abs_diff_sampled": sdiff,
        "worst_step_sampled": sstep,
        "rank_mismatches": sum(s.rank is not None and s.rank != r for s, r in zip(trace.steps, ranks)),
        "logprobs": lp,
        "sampled_logprobs": [None if math.isinf(x) else x for x in slp],
    }
    if trace.prompt_logprobs is not None:
        recorded = [t.logprob for t in trace.prompt_logprobs[1:]]
        out["max_abs_diff_prompt"] = _worst([abs(a - b) for a, b in zip(recorded, prompt_lp)])[0]
    return out
