"""The figures of the audit: a server's token logprobs against the model's (per-token |Δ|, KL
over the returned alternatives, same top-1, in the spirit of `llama-perplexity
--kl-divergence`), and one answer of the server against another of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace.comparison.audit.reference import Forced, Reference
from lmtrace.comparison.parse import Token, token_bytes


def stats(values: list[float]) -> dict[str, float | None]:
    """mean, max and 99th percentile (nearest rank) of |values|; None when there are none."""
    xs = sorted(abs(v) for v in values if v is not None and math.isfinite(v))
    if not xs:
        return {"mean": None, "max": None, "p99": None}
    p99 = xs[max(0, math.ceil(0.99 * len(xs)) - 1)]
    return {"mean": math.fsum(xs) / len(xs), "max": xs[-1], "p99": p99}


@dataclass
class Agreement:
    """A server's tokens teacher-forced: one record per token that has a number."""

    forced: Forced
    records: list[dict[str, Any]] = field(default_factory=list)
    unmapped: int | None = None  # the first token no token of this tokenizer has the bytes of

    def diffs(self) -> list[float]:
        return [r["diff"] for r in self.records if r["diff"] is not None]

    def worst(self, limit: int = 5) -> list[dict[str, Any]]:
        """The records with the largest |Δ|, in token order: the evidence of a disagreement."""
        top = sorted(self.records, key=lambda r: -abs(r["diff"] or 0.0))[:limit]
        return sorted(top, key=lambda r: r["index"])

    def first_above(self, tolerance: float) -> dict[str, Any] | None:
        return next((r for r in self.records if r["diff"] is not None and abs(r["diff"]) > tolerance), None)


def against_model(ref: Reference, prompt: list[int], tokens: list[Token]) -> Agreement:
    """The tokens' logprobs (server) against teacher forcing (lmtrace) after `prompt`."""
    ids, unmapped = ref.ids_of(tokens)
    forced = ref.forced(prompt, ids)
    rows = forced.generated()
    out = Agreement(forced, unmapped=unmapped)
    for i, (tok, token_id) in enumerate(zip(tokens, ids)):
        model = float(rows[i, token_id])
        diff = None if tok.logprob is None else tok.logprob - model
        rank = int((rows[i] > rows[i, token_id]).sum()) + 1
        out.records.append(
            {
                "index": i,
                "token": tok.text,
                "token_id": token_id,
                "server": tok.logprob,
                "lmtrace": model,
                "diff": diff,
                "rank": rank,
                "gap": float(rows[i].max()) - model,
            }
        )
    return out


def top_kl(ref: Reference, agreement: Agreement, tokens: list[Token]) -> dict[str, Any]:
    """KL(server || model) over each position's returned alternatives (both renormalised to that
    set), its mean and 99th percentile, and how often the server's best alternative is the model's."""
    rows = agreement.forced.generated()
    kls, same = [], []
    for i in range(rows.shape[0]):
        alts = [(ref.id_of(a), a.logprob) for a in tokens[i].top]
        alts = [(t, lp) for t, lp in alts if t is not None and lp is not None and math.isfinite(lp)]
        if not alts:
            continue
        best = max(alts, key=lambda a: a[1])[0]
        same.append(best == int(rows[i].argmax()))
        if len({t for t, _ in alts}) >= 2:
            p = torch.softmax(torch.tensor([lp for _, lp in alts], dtype=torch.float64), 0)
            q = torch.softmax(rows[i, [t for t, _ in alts]].double(), 0)
            kls.append(float((p * (p / q).log()).sum()))
    s = stats(kls)
    return {"kl_mean": s["mean"], "kl_p99": s["p99"], "same_top1": sum(same) / len(same) if same else None}


def _key(tok: Token) -> bytes:
    return token_bytes(tok.text, tok.bytes)


def _top_diff(a: Token, b: Token) -> tuple[float | None, bool, float]:
    """For one position of two answers: (the largest |Δ| of the alternatives both name; whether
    they name the same ones; how far a token only one names lies above the other's least
    alternative: near 0 for near-tied tokens swapped at the edge of the top N, large for a wrong set)."""
    x = {_key(t): t.logprob for t in a.top if t.logprob is not None}
    y = {_key(t): t.logprob for t in b.top if t.logprob is not None}
    deltas = [abs(x[k] - y[k]) for k in x.keys() & y.keys()]
    gaps = [x[k] - min(y.values(), default=x[k]) for k in x.keys() - y.keys()]
    gaps += [y[k] - min(x.values(), default=y[k]) for k in y.keys() - x.keys()]
    return max(deltas, default=None), x.keys() == y.keys(), max(gaps, default=0.0)


def server_vs_server(a: list[Token], b: list[Token]) -> dict[str, Any]:
    """Two of the server's answers that should be the same: same tokens, and the largest |Δ| of
    their logprobs and of their alternatives' (compared where both have them)."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if _key(a[i]) != _key(b[i])), None)
    if first is None and len(a) != len(b):
        first = n
    upto = n if first is None else first
    deltas = [
        abs(x.logprob - y.logprob)
        for x, y in zip(a[:upto], b[:upto])
        if x.logprob is not None and y.logprob is not None
    ]
    nulls = [i for i in range(upto) if (a[i].logprob is None) != (b[i].logprob is None)]
    tops = [_top_diff(x, y) for x, y in zip(a[:upto], b[:upto])]
    top_max = max((d for d, _, _ in tops if d is not None), default=0.0)
    other_sets = [i for i, (_, same, _) in enumerate(tops) if not same]
    worst = max(range(upto), key=lambda i: abs((a[i].logprob or 0.0) - (b[i].logprob or 0.0)), default=None)
    return {
        "tokens": [len(a), len(b)],
        "first_token_mismatch": first,
        "max_abs_diff": max(deltas, default=0.0),
        "max_abs_diff_top": top_max,
        "top_set_mismatches": other_sets,
        "top_set_gap": max((g for _, _, g in tops), default=0.0),
        "null_mismatches": nulls,
        "worst_index": worst,
        "identical": first is None and not nulls and not other_sets and max(deltas, default=0.0) == top_max == 0.0,
    }


def differs(d: dict[str, Any], tolerance: float) -> str | None:
    """Why two answers compared by server_vs_server are not the same, or None."""
    if d["first_token_mismatch"] is not None:
        return f"the tokens differ from token {d['first_token_mismatch']} on ({d['tokens'][0]} vs {d['tokens'][1]})"
    if d["null_mismatches"]:
        return f"token {d['null_mismatches'][0]} has a logprob in one answer and null in the other"
    if d["max_abs_diff"] > tolerance:
        return f"token logprobs differ by up to {d['max_abs_diff']:.3g} nats (token {d['worst_index']})"
    if d["max_abs_diff_top"] > tolerance:
        return f"the top_logprobs values differ by up to {d['max_abs_diff_top']:.3g} nats"
    if d["top_set_gap"] > tolerance:  # not two near-tied tokens swapped at the edge of the top N
        i = d["top_set_mismatches"][0]
        return f"the top_logprobs name other tokens (token {i}; {d['top_set_gap']:.3g} nats above the other's least)"
    return None


def token_view(tokens: list[Token], limit: int = 40) -> list[dict[str, Any]]:
    """A compact copy of an answer's tokens for evidence."""
    out = []
    for t in tokens[:limit]:
        out.append({"token": t.text, "logprob": t.logprob, "top": {a.text: a.logprob for a in t.top}})
    return out
