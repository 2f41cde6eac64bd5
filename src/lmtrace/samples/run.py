"""`lmtrace.sample`: N seeded samples of one prompt decoded as rows of one batch (continuous
batching: each row its own generator, so each is token-identical to the same seed decoded
alone), each with its uncertainty; the answers, votes and answer-level scores over them; with
`deepconf`, DeepConf's online early stop (samples/early.py).

    result = lmtrace.sample(lm, "What is 7 * 8? Answer:", n=16, answer_regex=r"(\\d+)",
                            temperature=0.7, max_new_tokens=16)
    result.votes["majority"]["answer"]; result.samples[3]["answer"]; result.traces[3]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from lmtrace import arguments
from lmtrace.decode.continuous import ContinuousBatch, RowSpec
from lmtrace.decode.row_state import make_params
from lmtrace.decode.tracing import encode_prompt
from lmtrace.decode.uncertainty import Uncertainty
from lmtrace.errors import InvalidParameter
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Trace
from lmtrace.samples import answers, early, settings, votes
from lmtrace.samples.summary import sample_entry, scores_over

__all__ = ["SampleResult", "sample"]


@dataclasses.dataclass
class SampleResult:
    """What `sample` found: the settings, one entry per sample, the votes, the answer-level
    scores, the early stop's record (None without one) and every sample's full trace."""

    prompt: str
    params: dict[str, Any]
    settings: dict[str, Any]
    samples: list[dict[str, Any]]
    votes: dict[str, Any]
    scores: dict[str, Any]
    early_stop: dict[str, Any] | None
    traces: list[Trace]

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "traces"}
        d["traces"] = [t.to_dict() for t in self.traces]
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


def sample(
    lm: LM,
    prompt: str,
    n: int = 16,
    params: SamplingParams | None = None,
    options: settings.SampleOptions | None = None,
    **kwargs: Any,
) -> SampleResult:
    """`n` samples of `prompt`, sample i seeded with seed + i (seed: the params' own, else 0).
    `options` (samples.settings.SampleOptions), or its fields as keywords; the other keywords are
    sampling settings laid over `params`. `answer_regex`: the answer is its first group (else the
    whole match); a sample where it never
    matches has no answer. `choice`: each sample constrained to one of these options (and the
    options' exact probabilities give the choice entropy, no sampling needed). `deepconf` "low" or
    "high": DeepConf's online early stop after `warmup` traces, ending at `consensus`.
    `on_row(i, trace)` is called as each sample finishes."""
    own, sampling = arguments.split(settings.SampleOptions, kwargs)
    o = arguments.options(settings.SampleOptions, options, "sample", own)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidParameter(f"n must be an integer >= 1, got {n!r}")
    if o.answer_regex is not None and o.choice:
        raise InvalidParameter("answer_regex and choice: give one or the other (a choice is its own answer)")
    settings.check(o.deepconf, o.warmup, n, o.consensus)
    regex = answers.compile_regex(o.answer_regex)
    p = make_params(params, "sample", **sampling)
    if o.choice:
        p = make_params(p, choice=list(o.choice))
    base = p.seed if p.seed is not None else 0
    observer = Uncertainty(o.confidence_k, o.confidence_window, o.confidence_tail, vocab=lm.model.config.vocab_size)
    ids = encode_prompt(lm, prompt, o.chat)
    specs = [RowSpec(list(ids), make_params(p, seed=base + i), prompt, o.chat, observers=[observer]) for i in range(n)]
    if o.deepconf is None:
        traces = decode(lm, specs, o.max_batch, o.on_row)
        stops: list[str | None] = [None] * n
        record = None
    else:
        warmup = settings.warmup_size(n, o.warmup)
        traces, stops, record = decode_online(lm, specs, o.max_batch, o.deepconf, warmup, o.consensus, regex, o.on_row)
    entries = [sample_entry(i, base + i, t, stops[i], regex) for i, t in enumerate(traces)]
    _phases(entries, record)
    chosen = {
        "n": n,
        "answer_regex": o.answer_regex,
        "choice": list(o.choice),
        "deepconf": o.deepconf,
        "warmup": None if record is None else record["warmup"],
        "consensus": o.consensus,
        "confidence_k": o.confidence_k,
        "confidence_window": o.confidence_window,
        "confidence_tail": o.confidence_tail,
        "max_batch": o.max_batch,
    }
    found_votes, scores = scores_over(entries, [t for t in traces if t is not None], o.deepconf)
    return SampleResult(
        prompt, p.to_dict(), chosen, entries, found_votes, scores, record, [t for t in traces if t is not None]
    )


def _phases(entries: list[dict[str, Any]], record: dict[str, Any] | None) -> None:
    """DeepConf's phases: each sample's `phase` (warmup or final) and whether it is `kept`."""
    if record is None:
        return
    for e in entries:
        e["phase"] = "warmup" if e["index"] < record["warmup"] else "final"
        above = e["phase"] == "final" or e["lowest_group"] >= record["threshold"]
        e["kept"] = e["decoded"] and e["stopped"] is None and above


def decode(
    lm: LM,
    specs: Sequence[RowSpec],
    max_batch: int,
    on_row: Callable | None = None,
    finished: Callable[[int, Trace], None] | None = None,
    offset: int = 0,
) -> list[Trace]:
    """Every row decoded, `max_batch` at a time (decode.continuous.generate_rows with a callback
    as each row leaves); `finished(i, trace)` may end the remaining rows (their on_step)."""
    batch = ContinuousBatch(lm, max_batch)
    waiting = list(enumerate(specs))
    out: list[Trace | None] = [None] * len(specs)
    rows: dict[int, int] = {}
    while waiting or not batch.empty:
        arriving, waiting = waiting[: batch.free], waiting[batch.free :]
        for (i, _), row in zip(arriving, batch.join_many([spec for _, spec in arriving])):
            rows[id(row)] = i
        for row in batch.step():
            if row.error is not None:
                raise row.error
            i = rows[id(row)]
            out[i] = row.trace
            if on_row is not None:
                on_row(offset + i, row.trace)
            if finished is not None:
                finished(i, row.trace)
    return out  # type: ignore[return-value]


def decode_online(
    lm: LM,
    specs: list[RowSpec],
    max_batch: int,
    mode: str,
    warmup: int,
    tau: float,
    regex: Any,
    on_row: Callable | None,
) -> tuple[list[Trace | None], list[str | None], dict[str, Any]]:
    """DeepConf online: the warm-up rows in full, the threshold, then the other rows each stopped
    below it, and every row not yet done stopped once the kept traces reach consensus."""
    window = specs[0].observers[0].window  # type: ignore[attr-defined]
    first = decode(lm, specs[:warmup], max_batch, on_row)
    lowest = [t.uncertainty["deepconf"]["lowest_group"] for t in first]
    threshold = early.percentile(lowest, settings.PERCENTILE[mode])
    kept_answers, kept_conf = [], []
    for t, c in zip(first, lowest):
        if c >= threshold:
            kept_answers.append(_answer(t, regex))
            kept_conf.append(c)
    state = early.Online(threshold, window, specs[0].params.max_new_tokens)
    stops: list[str | None] = [None] * len(specs)
    state.ended = _agreed(kept_answers, kept_conf, tau, warmup)
    rest: list[Trace | None] = [None] * (len(specs) - warmup)
    if not state.ended:
        final = [dataclasses.replace(s, on_step=state.stopper(stops, warmup + i)) for i, s in enumerate(specs[warmup:])]

        def finished(i: int, trace: Trace) -> None:
            if stops[warmup + i] is None:
                kept_answers.append(_answer(trace, regex))
                kept_conf.append(trace.uncertainty["deepconf"]["lowest_group"])
                state.ended = state.ended or _agreed(kept_answers, kept_conf, tau, warmup)

        rest = decode(lm, final, max_batch, on_row, finished, offset=warmup)  # type: ignore[assignment]
    else:
        stops[warmup:] = ["consensus"] * (len(specs) - warmup)
    record = {
        "mode": mode,
        "warmup": warmup,
        "percentile": settings.PERCENTILE[mode],
        "threshold": threshold,
        "group": state.group,
        "consensus": tau,
        "consensus_reached": state.ended,
        "warmup_lowest_groups": lowest,
    }
    return [*first, *rest], stops, record


def _answer(trace: Trace, regex: Any) -> str | None:
    raw = answers.extract(trace.text, regex)
    return None if raw is None else answers.normalise(raw)


def _agreed(found: list[str | None], confidences: list[float], tau: float, least: int) -> bool:
    """Consensus: the kept traces' weighted vote gives the leading answer a share >= tau, once at
    least `least` traces (the warm-up's count) are kept; one kept trace alone is no consensus."""
    if len(found) < max(2, least):
        return False
    share = votes.weighted(found, confidences)["share"]
    return share is not None and share >= tau
