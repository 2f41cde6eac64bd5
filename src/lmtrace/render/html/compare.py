"""The comparison as an HTML report: the engine's text with each token coloured by how well
the model agrees (exp(-|Δ logprob|): 1 is the same number), the per-token figures in its panel."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lmtrace.files import write_atomic
from lmtrace.render.html.trace import render_html


def as_score(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The comparison in the score-result shape the report reads; the colour is the agreement."""
    tokens = []
    for r in d["tokens"]:
        agreement = None if r["diff"] is None else -abs(r["diff"])
        tokens.append(
            {
                "index": r["index"],
                "token_id": r["token_id"],
                "text": r["token"],
                "logprob": agreement,
                "rank": r["model_rank"],
                "engine_logprob": r["engine_logprob"],
                "model_logprob": r["model_logprob"],
                "model_processed_logprob": r["model_processed_logprob"],
                "diff": r["diff"],
                "kl_top": r["kl_top"],
                "engine_top1": r["engine_top1"],
            }
        )
    s = d["summary"]
    mean = s.get("mean_abs_diff")
    return {
        "model": f"{source} vs {d['kind']}",
        "tokens": tokens,
        # the report's headline number: exp(mean |Δ|), 1.0 when the engine agrees exactly
        "perplexity": math.exp(mean) if mean is not None else None,
        "verdict": s["verdict"],
        "reason": s["reason"],
        "top1_agreement": s["top1_agreement"],
        "mean_abs_diff": mean,
        "max_abs_diff": s["max_abs_diff"],
        "colour": "exp(-|engine logprob - model logprob|)",
    }


def write_compare_html(path: str | Path, d: dict[str, Any], source: str) -> None:
    write_atomic(path, render_html(as_score(d, source), title=f"lmtrace · compare · {d['kind']}"))
