"""One entry per sample (its answer, length, stop and scores) and the votes and answer-level
uncertainty over the entries; no torch."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from lmtrace.records import Trace
from lmtrace.samples import answers, settings, votes


def sample_entry(
    index: int, seed: int, trace: Trace | None, stopped: str | None, regex: re.Pattern | None
) -> dict[str, Any]:
    """{index, seed, decoded, text, raw_answer, answer, matched, tokens, finish_reason, stopped,
    kept, log_prob, sampled_log_prob, lowest_group, deepconf, mean_nll, mean_entropy}."""
    if trace is None:  # never decoded: sampling had ended at consensus
        return {
            "index": index,
            "seed": seed,
            "decoded": False,
            "text": None,
            "raw_answer": None,
            "answer": None,
            "matched": False,
            "tokens": 0,
            "finish_reason": None,
            "stopped": stopped,
            "kept": False,
            "log_prob": None,
            "sampled_log_prob": None,
            "lowest_group": None,
            "deepconf": None,
            "mean_nll": None,
            "mean_entropy": None,
        }
    raw = answers.extract(trace.text, regex)
    u = trace.uncertainty
    return {
        "index": index,
        "seed": seed,
        "decoded": True,
        "text": trace.text,
        "raw_answer": raw,
        "answer": None if raw is None else answers.normalise(raw),
        "matched": raw is not None,
        "tokens": len(trace.steps),
        "finish_reason": trace.finish_reason,
        "stopped": stopped,
        "kept": stopped is None,
        "log_prob": math.fsum(s.logprob for s in trace.steps),
        "sampled_log_prob": math.fsum(s.sampled_logprob for s in trace.steps),
        "lowest_group": u["deepconf"]["lowest_group"],
        "deepconf": {k: v for k, v in u["deepconf"].items() if k != "groups"},
        "mean_nll": u["mean_nll"],
        "mean_entropy": u["mean_entropy"],
    }


def scores_over(
    entries: Sequence[dict[str, Any]], traces: Sequence[Trace], mode: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(votes, scores) over the kept samples: majority, DeepConf's weighted votes, semantic
    entropy (raw and processed sequence probabilities), the discrete one, Monte-Carlo sequence
    entropy, NumSets, and with a choice constraint the exact choice entropy."""
    kept = [e for e in entries if e["kept"]]
    found = [e["answer"] for e in kept]
    conf = [e["lowest_group"] for e in kept]
    found_votes = {
        "majority": votes.majority(found),
        "weighted": votes.weighted(found, conf, 100.0),
        "top10": votes.weighted(found, conf, settings.ETA["low"]),
        "top90": votes.weighted(found, conf, settings.ETA["high"]),
    }
    for vote in found_votes.values():  # positions among the kept samples -> the samples' own indices
        if "kept" in vote:
            vote["kept"] = [kept[i]["index"] for i in vote["kept"]]
    # the online early stop already filtered by its threshold: its vote weighs every kept trace
    found_votes["deepconf"] = found_votes["weighted"] if mode is not None else found_votes["top90"]
    by_index = {t_i: t for t_i, t in zip([e["index"] for e in entries if e["decoded"]], traces)}
    token_lps = [[s.logprob for s in by_index[e["index"]].steps] for e in kept]
    scores = {
        "samples": len(entries),
        "kept": len(kept),
        "answered": sum(a is not None for a in found),
        "unmatched": [e["index"] for e in kept if not e["matched"]],
        "semantic_entropy": votes.semantic_entropy(found, [e["log_prob"] for e in kept]),
        "sampled_semantic_entropy": votes.semantic_entropy(found, [e["sampled_log_prob"] for e in kept]),
        "discrete_semantic_entropy": votes.discrete_semantic_entropy(found),
        "mc_sequence_entropy": votes.mc_sequence_entropy([e["log_prob"] for e in kept]),
        "sampled_mc_sequence_entropy": votes.mc_sequence_entropy([e["sampled_log_prob"] for e in kept]),
        "mc_normalized_entropy": votes.mc_normalized_entropy(token_lps),
        "num_sets": votes.num_sets(found),
        "tokens": sum(e["tokens"] for e in entries),
    }
    choices = next((t.choices for t in traces if t.choices), None)
    if choices:
        scores["choices"] = [{"text": c["text"], "logprob": c["logprob"]} for c in choices]
        scores["choice_entropy"] = votes.choice_entropy(choices)
    return found_votes, scores
