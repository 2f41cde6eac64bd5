"""A vLLM RequestOutput as an lmtrace Trace: the same records as lmtrace's own engine.

vLLM reports one distribution per engine (its `logprobs_mode`); lmtrace's teacher-forced
rescoring of the same tokens (lmtrace.vllm.rescore) gives the other one and the entropies, and
checks the numbers vLLM reported. Which number came from where is written in the trace header,
`model.engine` (see `provenance`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmtrace.detokenize import TokenBytes
from lmtrace.kv import size as kvsize
from lmtrace.logits.forced import token_scores
from lmtrace.model.lm import LM, model_record
from lmtrace.params import SamplingParams
from lmtrace.records import Alternative, Step, Trace
from lmtrace.records.alternatives import alternative
from lmtrace.records.steps import StepNumbers, new_step
from lmtrace.records.timing import timing
from lmtrace.records.traces import new_trace
from lmtrace.versions import versions
from lmtrace.vllm.kv import KVLayout
from lmtrace.vllm.params import VLLM_ORDER
from lmtrace.vllm.rescore import Rescored, rescore
from lmtrace.vllm.text import completion_text

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"
RESCORING = "lmtrace teacher-forced rescoring (transformers, float32)"


@dataclass
class Request:
    """What was asked of vLLM for one trace."""

    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    chat: bool = False
    echo: bool = False


def provenance(mode: str, version: str) -> dict[str, Any]:
    """Where each number of the steps comes from, for the trace header."""
    engine = f"vLLM {version} ({mode})"
    if mode == RAW:
        from_engine = ["token_id", "logprob", "rank", "top[].token_id", "top[].logprob"]
        from_rescoring = ["entropy", "sampled_logprob", "sampled_entropy", "top[].sampled_logprob"]
    else:
        from_engine = ["token_id", "sampled_logprob", "top[].sampled_logprob (tokens in vLLM's top list)"]
        from_rescoring = ["logprob", "rank", "entropy", "sampled_entropy", "top[] (the raw top-n)"]
    return {
        "name": "vllm",
        "version": version,
        "logprobs_mode": mode,
        "numbers": {engine: from_engine, RESCORING: from_rescoring},
        "processors": VLLM_ORDER + " (vLLM's order; lmtrace's own puts min_p last)",
    }


def _engine_numbers(output: Any) -> list[dict[int, Any]]:
    return list(output.logprobs or [])


def _top_raw_mode(vllm_lp: dict[int, Any], n: int, res: Rescored, i: int, tb: TokenBytes) -> list[Alternative]:
    ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in vllm_lp.items() if lp.rank is not None and lp.rank <= n))
    used = res.processed[i]
    return [alternative(t, lp, float(used[t]), tb) for _, t, lp in ranked]


def _top_processed_mode(vllm_lp: dict[int, Any], res: Rescored, i: int, tb: TokenBytes) -> list[Alternative]:
    used = res.processed[i]
    out = []
    for t, lp in zip(res.top_ids[i], res.top_logprobs[i]):
        slp = vllm_lp[t].logprob if t in vllm_lp else float(used[t])
        out.append(alternative(t, lp, slp, tb))
    return out


@dataclass(frozen=True)
class Reading:
    """What every step of one vLLM output is read with: the engine's `mode` (RAW or processed
    logprobs), the rescoring `res` of its tokens, `n` alternatives a step, the token bytes `tb`."""

    mode: str
    res: Rescored
    n: int
    tb: TokenBytes


def _step(
    i: int, token: int, piece: str, vllm_lp: dict[int, Any], kv: dict[str, Any], time_ms: float, reading: Reading
) -> Step:
    """Step `i` (`token`, its text `piece`) from vLLM's logprobs `vllm_lp` and the rescoring."""
    mode, res, n, tb = reading.mode, reading.res, reading.n, reading.tb
    own = vllm_lp[token]
    if mode == RAW:
        logprob, rank, sampled = own.logprob, own.rank, res.sampled_logprob[i]
        top = _top_raw_mode(vllm_lp, n, res, i, tb)
    else:
        logprob, rank, sampled = res.logprob[i], res.rank[i], own.logprob
        top = _top_processed_mode(vllm_lp, res, i, tb)
    numbers = StepNumbers(logprob, sampled, rank, res.entropy[i], res.sampled_entropy[i])
    return new_step(i, token, piece, numbers, top, tb, kv=kv, time_ms=time_ms)


def check(mode: str, steps: list[Step], res: Rescored) -> dict[str, Any]:
    """The largest difference between what vLLM reported and lmtrace's rescoring of the same side."""
    if mode == RAW:
        pairs = [(s.logprob, r) for s, r in zip(steps, res.logprob)]
        ranks = sum(s.rank != r for s, r in zip(steps, res.rank))
    else:
        pairs = [(s.sampled_logprob, r) for s, r in zip(steps, res.sampled_logprob)]
        ranks = None
    diffs = [0.0 if math.isinf(a) and a == b else abs(a - b) for a, b in pairs]
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else None
    out = {"against": RESCORING, "max_abs_diff": diffs[worst] if diffs else None, "worst_step": worst}
    if ranks is not None:
        out["rank_mismatches"] = ranks
    return out


def _step_times(output: Any, steps: int, wall_ms: float) -> tuple[list[float], str]:
    """Per-step milliseconds from vLLM's request metrics where it kept them, else the batch's
    wall time spread evenly over the row's steps."""
    m = getattr(output, "metrics", None)
    first, last, scheduled = (getattr(m, k, None) for k in ("first_token_ts", "last_token_ts", "scheduled_ts"))
    if m is not None and first and last and scheduled and steps:
        decode = (last - first) * 1000 / max(steps - 1, 1)
        return [(first - scheduled) * 1000] + [decode] * (steps - 1), "vllm request metrics (decode steps: their mean)"
    return [wall_ms / max(steps, 1)] * steps, "the batch's wall time spread over the steps"


def to_trace(lm: LM, request: Request, result: Any, engine: dict[str, Any], layout: KVLayout, wall_ms: float,
             res: Rescored | None = None) -> Trace:  # fmt: skip
    """The Trace of one vLLM RequestOutput (`result`). `engine`: provenance(...) of the engine;
    `res`: the rescoring of its tokens when already done (rescore_many), else done here."""
    output = result.outputs[0]
    ids, p = list(output.token_ids), request.params
    n = p.top_logprobs
    if res is None:
        res = rescore(lm, request.prompt_ids, ids, p, n, echo=request.echo)
    eos = lm.eos_token_ids if p.stop_on_eos else []
    text = completion_text(lm.tokenizer, ids, p.stop, eos, ended=output.finish_reason == "stop")
    tb = TokenBytes(lm.tokenizer)
    times, time_source = _step_times(result, len(ids), wall_ms)
    numbers = _engine_numbers(output)
    cached = getattr(result, "num_cached_tokens", 0) or 0
    reading = Reading(engine["logprobs_mode"], res, n, tb)
    steps = [
        _step(i, t, text.pieces[i], numbers[i], layout.step(len(request.prompt_ids) + i, cached), times[i], reading)
        for i, t in enumerate(ids)
    ]  # fmt: skip
    summary = lm.summary.to_dict()
    model = {**model_record(lm.source, summary), "dtype": layout.dtype, "device": layout.device}
    model["engine"] = {**engine, "kv": layout.header(), "check": check(engine["logprobs_mode"], steps, res)}
    return new_trace(
        steps,
        text=text.text,
        finish_reason=text.finish_reason,
        stop_reason=text.stop_reason,
        model=model,
        params={**p.to_dict(), "chat": request.chat, **({"echo": True} if request.echo else {})},
        prompt={"text": request.prompt, "token_ids": list(request.prompt_ids)},
        timing=timing(times, len(request.prompt_ids), source=time_source),
        versions={**versions(), "vllm": engine["version"]},
        kv_anatomy=_anatomy(lm, layout.dtype),
        prompt_logprobs=_prompt_scores(lm, request, result, res, tb),
        origin="vllm",
    )


def _anatomy(lm: LM, dtype: str) -> dict[str, Any]:
    try:
        d = kvsize.anatomy(lm.model.config, dtype, 1).to_dict()
    except kvsize.InvalidParameter as e:
        return {"unsupported": str(e)}
    d["mismatches"] = []  # the steps' bytes are the formula's, not a measurement: nothing to compare
    return d


def _prompt_scores(lm: LM, request: Request, result: Any, res: Rescored, tb: TokenBytes) -> list | None:
    """With echo: the prompt's tokens, vLLM's prompt_logprobs (raw) for logprob, rank and
    alternatives, lmtrace's rescoring for the entropy."""
    if not request.echo or res.prompt is None:
        return None
    numbers = res.prompt
    reported = list(getattr(result, "prompt_logprobs", None) or [])
    for j, entry in enumerate(reported[1:]):  # position 0 has no context: vLLM gives None
        token = request.prompt_ids[j + 1]
        if entry and token in entry:
            numbers.logprob[j], numbers.rank[j] = entry[token].logprob, entry[token].rank
            top = request.params.top_logprobs
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank and lp.rank <= top)
            numbers.top_ids[j] = [t for _, t, _ in ranked]
            numbers.top_logprobs[j] = [lp for _, _, lp in ranked]
    return token_scores(lm.tokenizer, request.prompt_ids, 0, numbers, tb)
