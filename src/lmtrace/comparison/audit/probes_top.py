"""The `top_logprobs` probe: each position's alternatives, on /v1/completions (a dict) and
/v1/chat/completions (a list): as many as asked (plus the chosen token when it is not among
them, as OpenAI's completions do; no other extra), a list sorted, no token twice, and each
value the model's raw logprob, the set the model's own top N."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.comparison.audit.base import MESSAGES, TOP_N, Context, fmt, tokens_of, verdict
from lmtrace.comparison.audit.numbers import against_model
from lmtrace.comparison.audit.result import ProbeResult
from lmtrace.comparison.parse import Token, token_bytes

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The three largest oceans on Earth are"


def _position(
    ctx: Context, row: torch.Tensor, chosen: int, alts: list[Token], ordered: bool
) -> tuple[list[str], float]:
    """Problems with one position's alternatives, and their largest |Δ| against the model."""
    problems = []
    keys = [token_bytes(a.text, a.bytes) for a in alts]
    ids = [ctx.ref.id_of(a) for a in alts]
    if len(set(keys)) < len(keys):
        twice = next(a.text for a, k in zip(alts, keys) if keys.count(k) > 1)
        problems.append(f"{twice!r} appears twice among the alternatives (vLLM #36660, #36746)")
    if len(alts) not in (TOP_N, TOP_N + 1):
        problems.append(f"{len(alts)} alternatives where {TOP_N} were asked")
    elif len(alts) == TOP_N + 1 and chosen not in ids and not problems:
        problems.append(f"{TOP_N + 1} alternatives for {TOP_N} asked, and the extra one is not the chosen token")
    values = [a.logprob for a in alts]
    if ordered and any(b is not None and a is not None and b > a + ctx.tolerance for a, b in zip(values, values[1:])):
        problems.append("the alternatives are not sorted, most likely first")
    deltas = [abs(v - float(row[i])) for i, v in zip(ids, values) if i is not None and v is not None]
    worst = max(deltas, default=0.0)
    if worst > ctx.tolerance:
        problems.append(f"an alternative's logprob differs from the model's by {worst:.3g} nats")
    nth = float(torch.topk(row, TOP_N).values[-1])
    outside = [
        a.text for a, i in zip(alts, ids) if i is not None and i != chosen and float(row[i]) < nth - ctx.tolerance
    ]
    if outside and len(alts) >= TOP_N:
        problems.append(f"{outside[0]!r} is an alternative but not among the model's top {TOP_N}")
    if None in ids:
        problems.append(f"{alts[ids.index(None)].text!r} is no token of this tokenizer")
    return problems, worst


def _route(ctx: Context, path: str, body: dict[str, Any], prompt: list[int], ordered: bool) -> tuple[list, dict]:
    answer = ctx.post(path, body)
    tokens = tokens_of(answer["choices"][0], path)
    ag = against_model(ctx.ref, prompt, tokens)
    rows = ag.forced.generated()
    problems, worst, counts = [], 0.0, []
    for r in ag.records:
        alts = tokens[r["index"]].top
        counts.append(len(alts))
        found, w = _position(ctx, rows[r["index"]], r["token_id"], alts, ordered)
        worst = max(worst, w)
        problems += [f"{path} token {r['index']} ({r['token']!r}): {p}" for p in found]
    figures = {
        "positions": len(ag.records),
        "entries_min": min(counts, default=None),
        "entries_max": max(counts, default=None),
        "max_abs_diff": worst,
    }
    return problems, {"figures": figures, "answer": answer, "body": body}


def probe_top_logprobs(ctx: Context) -> ProbeResult:
    problems, done = _route(ctx, COMPLETIONS, ctx.completion(PROMPT), ctx.ref.prompt_ids(PROMPT), ordered=False)
    runs, evidence = {"completions": done}, ctx.evidence(COMPLETIONS, done["body"], done["answer"])
    if ctx.ref.has_chat_template():
        chat_problems, runs["chat"] = _route(ctx, CHAT, ctx.chat(MESSAGES), ctx.ref.chat_ids(MESSAGES), ordered=True)
        if chat_problems and not problems:  # the evidence of the first problem
            evidence = ctx.evidence(CHAT, runs["chat"]["body"], runs["chat"]["answer"])
        problems += chat_problems
    figures = {name: run["figures"] for name, run in runs.items()}
    worst = max(f["max_abs_diff"] for f in figures.values())
    ok = (
        f"{TOP_N} alternatives per token on {' and '.join(runs)} (the chosen one added where OpenAI adds it), "
        f"none twice, values the model's (max |Δ| {fmt(worst)})"
    )
    return verdict("top_logprobs", problems, ok, figures, evidence)
