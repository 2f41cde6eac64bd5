"""`lmtrace.rollouts(lm, records)`: does my trainer agree with my engine? Each rollout's ids
teacher-forced (float32, batched, a shared prompt computed once), per token the raw, processed,
engine's and trainer's logprobs and the split engine − raw = processing + residual, the
frameworks' summary metrics, the causes with their figures, and where two computations part."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lmtrace.model.lm import LM
from lmtrace.scoring.rollouts import causes, computed, metrics, options, probes, readers, respelled, tokens
from lmtrace.scoring.rollouts.rollout import Rollout, check, encode
from lmtrace.scoring.variants import worlds as variants
from lmtrace.scoring.variants.spec import VariantSpec, parse_variant
from lmtrace.versions import versions

FLAG_LOW, FLAG_HIGH = 0.9, 1.1  # a token is flagged when its ratio lies outside [0.9, 1.1]
MAX_TEMPERATURE_FITS = 256  # rollouts whose temperature is fitted (a search over the logits each)


def _num(x: float) -> float | None:
    """A JSON number; -inf (a token the processing removes) is written null."""
    return None if x == -math.inf else x


class Pass:
    """What the reference's pass keeps per rollout: raw and processed logprobs, and for a
    rollout that misfits, the other processings and the fitted temperature."""

    def __init__(self, rollouts: Sequence[Rollout], params: Sequence[Any]):
        self.rollouts, self.params = rollouts, params
        self.raw: list[list[float]] = [[] for _ in rollouts]
        self.processed: list[list[float]] = [[] for _ in rollouts]
        self.alternatives: dict[int, dict[str, list[float]]] = {}
        self.temperature: dict[int, tuple[float, float]] = {}

    def __call__(self, i: int, logits: torch.Tensor) -> None:
        r, p = self.rollouts[i], self.params[i]
        ids = torch.tensor(r.completion_ids, device=logits.device)
        raw, processed = tokens.raw_and_processed(logits, ids, p)
        self.raw[i], self.processed[i] = raw.tolist(), processed.tolist()
        if causes.clean(r.logprobs, self.processed[i]):
            return
        self.alternatives[i] = {k: v.tolist() for k, v in tokens.alternatives(logits, ids, p).items()}
        if not p.greedy and len(self.temperature) < MAX_TEMPERATURE_FITS:
            engine = torch.tensor(r.logprobs, device=logits.device)
            self.temperature[i] = tokens.temperature_fit(logits, ids, engine)


def _first_causes(run: Pass) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for i, r in enumerate(run.rollouts):
        if i not in run.alternatives:
            out.append([])
            continue
        found = causes.off_by_one(r.logprobs, run.processed[i]) or causes.processing(
            r.logprobs,
            run.processed[i],
            tokens.active(run.params[i]),
            run.alternatives[i],
            run.temperature.get(i),
            run.params[i].temperature,
        )
        out.append([found] if found else [])
    return out


def _diagnose(lm: LM, run: Pass, trainer: VariantSpec | None, status: Callable[[str], None]) -> tuple[list, list]:
    """Per rollout its causes; the variants that could not run."""
    found = _first_causes(run)
    todo = [i for i in run.alternatives if not found[i]]
    aligned = {i: causes.fit(run.rollouts[i].logprobs, run.processed[i]) for i in todo}
    skipped: list[dict[str, str]] = []
    if todo:
        status("re-tokenized prompts")
        for i, c in probes.retokenized(lm, run.rollouts, todo, run.params, aligned).items():
            found[i] = [c]
        todo = [i for i in todo if not found[i]]
    if todo:
        status("re-encoded completions")
        for i, c in respelled.retokenized(lm, run.rollouts, todo, run.params, aligned).items():
            found[i] = [c]
        todo = [i for i in todo if not found[i]]
    if todo:
        specs = probes.candidate_specs(lm, trainer)
        fits, skipped = probes.variant_fits(lm, run.rollouts, todo, run.params, specs, run.processed, status)
        for i in todo:
            found[i] = [causes.numeric_or_weights(aligned[i], fits[i])]
    return found, skipped


class Texts:
    """Each token id's own text, decoded once."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.known = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self.known:
            self.known[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.known[token_id]


def _token_rows(
    r: Rollout, raw: list[float], processed: list[float], trainer: list[float], text: Texts
) -> list[dict[str, Any]]:
    rows = []
    for j, (tid, e, a, p, t) in enumerate(zip(r.completion_ids, r.logprobs, raw, processed, trainer)):
        ratio = math.exp(min(t - e, 700.0)) if t != -math.inf else 0.0  # 700: float64's exp stays finite
        rows.append(
            {
                "index": j,
                "token_id": tid,
                "text": text(tid),
                "engine_logprob": e,
                "raw_logprob": a,
                "processed_logprob": _num(p),
                "trainer_logprob": _num(t),
                "processing": _num(p - a) if p != -math.inf else None,
                "residual": e - p if p != -math.inf else None,
                "ratio": ratio,
                "flagged": not FLAG_LOW <= ratio <= FLAG_HIGH,
            }
        )
    return rows


def to_json(report: dict[str, Any], indent: int | None = 2) -> str:
    """The report as JSON; a number that is not finite (an overflowing ratio) is written null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(report), ensure_ascii=False, indent=indent, allow_nan=False)


def prepare(lm: LM, records: Sequence[Any] | str | Path, fmt: str = "lmtrace") -> list[Rollout]:
    """The rollouts of `records` (dicts in `fmt`, Rollouts, or a file), checked against the model."""
    rollouts = readers.from_records(records, fmt)
    vocab = lm.model.get_input_embeddings().num_embeddings
    for r in rollouts:
        encode(r, lm.tokenizer)
        check(r, vocab)
    return rollouts


def _trainer_values(lm: LM, rs: Sequence[Any], params: list, run: Any, spec: Any, status: Callable) -> list:
    """The trainer's logprobs: the reference's own processed ones, or those of the variant that
    stands for the trainer (`spec`)."""
    if spec is None:
        return run.processed
    status(f"the trainer as {spec.spec}")
    world = variants.build(lm, spec)
    try:
        return computed.processed(lm, rs, params, world)
    finally:
        world.close()


def _rollout_entry(lm: LM, r: Any, found: Any, tokens: list) -> dict[str, Any]:
    """One rollout of the report: its id, line, prompt, sampling, causes and tokens."""
    return {
        "id": r.id,
        "line": r.line,
        "prompt_tokens": len(r.prompt_ids),
        "sampling": dict(r.sampling),
        "prompt_text": lm.tokenizer.decode(r.prompt_ids, skip_special_tokens=False),
        "causes": found,
        "tokens": tokens,
    }


def rollouts(
    lm: LM,
    records: Sequence[Any] | str | Path,
    trainer: str | VariantSpec | None = None,
    caps: Sequence[float] = (),
    locate: str | VariantSpec | None = None,
    *,
    fmt: str = "lmtrace",
    locate_threshold: float = 0.01,
    on_status: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The report of DESIGN.md's "Rollouts": {summary, rollouts: [{id, causes, tokens}], ...}.
    `trainer`: a stability variant spec whose processed logprobs stand for the trainer's (None:
    the reference's own float32 ones); `caps`: the TIS/MIS caps to tally; `locate`: a variant
    compared with the reference layer by layer at the worst flagged token."""
    from lmtrace.scoring.rollouts.locate import locate_worst

    status = on_status or (lambda _line: None)
    cap_list = options.check_caps(list(caps))
    trainer_spec = parse_variant(trainer) if trainer is not None else None
    locate_spec = parse_variant(locate) if locate is not None else None
    options.check_threshold(locate_threshold)
    if locate_spec is not None:
        options.check_locate(locate_spec)
    rs = prepare(lm, records, fmt)
    params = [r.params() for r in rs]
    started = time.perf_counter()
    status(f"teacher-forcing {len(rs)} rollouts")
    run = Pass(rs, params)
    computed.each(lm, rs, run)
    forced_s = time.perf_counter() - started
    trainer_values = _trainer_values(lm, rs, params, run, trainer_spec, status)
    found, skipped = _diagnose(lm, run, trainer_spec, status)
    text = Texts(lm.tokenizer)
    out_rollouts = [
        _rollout_entry(lm, r, found[i], _token_rows(r, run.raw[i], run.processed[i], trainer_values[i], text))
        for i, r in enumerate(rs)
    ]
    summary = metrics.summary([list(zip(r.logprobs, trainer_values[i])) for i, r in enumerate(rs)], cap_list)
    summary["flagged"] = sum(t["flagged"] for r in out_rollouts for t in r["tokens"])
    summary["causes"] = causes.tally(found)
    report = {
        "model": {
            "source": lm.source,
            "dtype": lm.summary.dtype,
            "device": lm.summary.device,
            **({"batch_invariant": True} if lm.summary.batch_invariant else {}),
        },
        "format": fmt,
        "trainer": trainer_spec.spec if trainer_spec is not None else "reference",
        "summary": summary,
        "rollouts": out_rollouts,
        "skipped_variants": skipped,
        "timing": {
            "total_s": time.perf_counter() - started,
            "forced_s": forced_s,
            "tokens_per_s": summary["tokens"] / forced_s if forced_s > 0 else None,
        },
        "versions": versions(),
    }
    if locate_spec is not None:
        status(f"locating against {locate_spec.spec}")
        report["locate"] = locate_worst(lm, rs, out_rollouts, locate_spec, locate_threshold)
    return report
