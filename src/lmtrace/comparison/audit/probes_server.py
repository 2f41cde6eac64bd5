"""The probes that hold the server to its own answers: `streaming` (streamed = not streamed),
`prompts` (a prompt list with n > 1: each choice equal to its prompt alone), `repeat` (the same
request twice, a warm prefix cache: the same numbers) and `concurrency` (a request alone and
among 8 concurrent others: the same numbers)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from threading import Barrier
from typing import Any

from lmtrace.comparison.audit.base import MESSAGES, Context, Skip, fmt, tokens_of, verdict
from lmtrace.comparison.audit.client import HTTPFailure
from lmtrace.comparison.audit.numbers import differs, server_vs_server, token_view
from lmtrace.comparison.audit.result import ProbeResult
from lmtrace.comparison.audit.streams import chat_stream, completion_stream, misaligned

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
STREAM_PROMPT = "A good breakfast includes"
PROMPTS = ["The first planet from the sun is", "My favourite food is"]
REPEAT_PROMPT = "In 1969, the first person to walk on the moon was"
TARGET = "The tallest mountain in the world is"
OTHERS = [
    "Tell me a story about a dragon.",
    "Water boils at",
    "1, 2, 3, 4,",
    "The opposite of hot is",
    "Photosynthesis is the process",
    "Dear diary, today",
    "import numpy as np\n",
    "Roses are red,",
]


def _stream_route(ctx: Context, path: str, body: dict[str, Any]) -> tuple[list[str], dict[str, Any], dict]:
    plain = ctx.post(path, body)["choices"][0]
    events = ctx.client.stream(path, {**body, "stream": True})
    streamed = (chat_stream if path == CHAT else completion_stream)(events)
    a, b = tokens_of(plain, path), tokens_of(streamed.choice, path)
    d = server_vs_server(a, b)
    text = lambda c: (c.get("message") or {}).get("content") if path == CHAT else c.get("text")  # noqa: E731
    problems = []
    if text(plain) != text(streamed.choice):
        problems.append(f"{path}: the streamed text {text(streamed.choice)!r} is not the answer's {text(plain)!r}")
    why = differs(d, ctx.tolerance)
    if why:
        problems.append(f"{path}: streamed vs not streamed: {why}")
    where = misaligned(ctx.ref, streamed.chunks, b)
    if where:
        problems.append(f"{path}: {where}")
    figures = {**d, "chunks": len(streamed.chunks)}
    evidence = {"plain": token_view(a), "streamed_chunks": events[:40]}
    return problems, figures, ctx.evidence(path, {**body, "stream": True}, None, **evidence)


def probe_streaming(ctx: Context) -> ProbeResult:
    """Streamed logprobs equal the non-streamed answer token by token, and line up with the text."""
    problems, figures, evidence = _stream_route(ctx, COMPLETIONS, ctx.completion(STREAM_PROMPT, logprobs=3))
    all_figures = {"completions": figures}
    if ctx.ref.has_chat_template():
        chat_problems, all_figures["chat"], chat_evidence = _stream_route(ctx, CHAT, ctx.chat(MESSAGES, top_logprobs=3))
        evidence = evidence if problems else chat_evidence
        problems += chat_problems
    worst = max(f["max_abs_diff"] for f in all_figures.values())
    ok = f"streamed = not streamed on {' and '.join(all_figures)}, token by token (max |Δ| {fmt(worst)})"
    return verdict("streaming", problems, ok, all_figures, evidence)


def probe_prompts(ctx: Context) -> ProbeResult:
    """A list of prompts with n > 1: choice i * n + j is prompt i's j-th, in order, each equal to
    its prompt sent alone (greedy, so every choice of a prompt is the same)."""
    alone = [
        tokens_of(ctx.post(COMPLETIONS, ctx.completion(p, logprobs=2))["choices"][0], COMPLETIONS) for p in PROMPTS
    ]
    body, n, note = ctx.completion(PROMPTS, logprobs=2, n=2), 2, None
    try:
        answer = ctx.post(COMPLETIONS, body)
    except HTTPFailure as e:
        if e.status not in (400, 422):
            raise
        note = f"n=2 with greedy decoding refused ({e.message()}): the prompt list checked with n=1"
        body, n = ctx.completion(PROMPTS, logprobs=2), 1
        answer = ctx.post(COMPLETIONS, body)
    choices = answer["choices"]
    indices = [c.get("index") for c in choices]
    problems = []
    if indices != list(range(len(PROMPTS) * n)):
        problems.append(
            f"choice indices come back as {indices}, expected {list(range(len(PROMPTS) * n))} "
            f"(choice i * n + j is prompt i's j-th)"
        )
    worst = 0.0
    for k, choice in enumerate(choices[: len(PROMPTS) * n]):
        d = server_vs_server(alone[k // n], tokens_of(choice, COMPLETIONS))
        worst = max(worst, d["max_abs_diff"])
        why = differs(d, ctx.tolerance)
        if why:
            problems.append(f"choice {k} (prompt {k // n}, {PROMPTS[k // n]!r}) is not that prompt alone: {why}")
    figures = {"prompts": len(PROMPTS), "n": n, "choices": len(choices), "max_abs_diff": worst, "note": note}
    evidence = ctx.evidence(COMPLETIONS, body, answer, alone=[token_view(t) for t in alone])
    ok = f"{len(choices)} choices for {len(PROMPTS)} prompts × n={n}, in order, each equal to its prompt alone "
    ok += f"(max |Δ| {fmt(worst)})" + (f"; {note}" if note else "")
    return verdict("prompts", problems, ok, figures, evidence)


def probe_repeat(ctx: Context) -> ProbeResult:
    """The same request twice (the second finds the prompt in a warm prefix cache): the same
    numbers, the prompt's (echo) included."""
    body, note = ctx.completion(REPEAT_PROMPT, echo=True), None
    try:
        first = ctx.post(COMPLETIONS, body)
    except HTTPFailure as e:
        if e.status not in (400, 422):
            raise
        body, note = ctx.completion(REPEAT_PROMPT), f"echo refused ({e.message()}): generated tokens only"
        first = ctx.post(COMPLETIONS, body)
    second = ctx.post(COMPLETIONS, body)
    d = server_vs_server(tokens_of(first["choices"][0], COMPLETIONS), tokens_of(second["choices"][0], COMPLETIONS))
    why = differs(d, ctx.tolerance)
    problems = (
        []
        if why is None
        else [
            f"the second of two identical requests: {why} (stale numbers from a warm prefix cache? vLLM #42019, #42245)"
        ]
    )
    figures = {**d, "echo": note is None, "note": note}
    evidence = ctx.evidence(COMPLETIONS, body, second, first_response=first)
    ok = (
        "two identical requests answered "
        + ("identically" if d["identical"] else f"within {fmt(d['max_abs_diff'])} nats")
        + (" (prompt logprobs included)" if note is None else f"; {note}")
    )
    return verdict("repeat", problems, ok, figures, evidence)


def _crowd(ctx: Context, target: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str], float]:
    """The target request sent among len(OTHERS) others at once: (its answer, the others'
    failures, seconds)."""
    bodies = [
        ctx.completion(
            p, max_tokens=ctx.max_tokens + 4 * (i % 3), logprobs=1, **({"temperature": 1.0, "seed": i} if i % 2 else {})
        )
        for i, p in enumerate(OTHERS)
    ]
    middle = len(bodies) // 2
    bodies.insert(middle, target)
    gate = Barrier(len(bodies))

    def send(body: dict[str, Any]) -> dict[str, Any] | str:
        gate.wait()
        try:
            return ctx.client.post(COMPLETIONS, body)
        except HTTPFailure as e:
            return f"HTTP {e.status}: {e.message()}"

    started = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(send, bodies))
    seconds = time.perf_counter() - started
    mine = answers.pop(middle)
    if isinstance(mine, str):
        raise HTTPFailure(429 if mine.startswith("HTTP 429") else 500, mine, {"body": target})
    return mine, [a for a in answers if isinstance(a, str)], seconds


def probe_concurrency(ctx: Context) -> ProbeResult:
    """A request alone, then the same among 8 concurrent others (other prompts, lengths, sampled
    and greedy): equal within tolerance, as batch-invariant numbers are."""
    body = ctx.completion(TARGET)
    started = time.perf_counter()
    alone = ctx.post(COMPLETIONS, body)
    alone_s = time.perf_counter() - started
    crowd, refused, crowd_s = _crowd(ctx, body)
    if crowd is None or not crowd.get("choices"):
        raise Skip("the request among others came back without choices")
    d = server_vs_server(tokens_of(alone["choices"][0], COMPLETIONS), tokens_of(crowd["choices"][0], COMPLETIONS))
    why = differs(d, ctx.tolerance)
    problems = (
        []
        if why is None
        else [
            f"alone vs among {len(OTHERS)} concurrent requests: {why} "
            "(batch-dependent numbers: vLLM RFC #42259, #42260)"
        ]
    )
    figures = {**d, "others": len(OTHERS), "others_refused": refused, "alone_s": alone_s, "crowd_s": crowd_s}
    evidence = ctx.evidence(COMPLETIONS, body, crowd, alone_response=alone)
    ok = f"alone and among {len(OTHERS) - len(refused)} concurrent requests: " + (
        "identical" if d["identical"] else f"within {fmt(d['max_abs_diff'])} nats"
    )
    return verdict("concurrency", problems, ok, figures, evidence)
