"""The probes that check the server's numbers against the model's own: `logprobs` (greedy and
sampled completions), `echo` (the prompt's logprobs) and `chat` (the chat route's logprobs and
bytes under the chat template)."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.comparison.audit.base import MESSAGES, TOP_N, Context, Skip, fmt, spellings, tokens_of, verdict
from lmtrace.comparison.audit.numbers import Agreement, against_model, stats, top_kl
from lmtrace.comparison.audit.result import ProbeResult
from lmtrace.comparison.verdict import fit_temperature

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"
SAMPLED_TEMPERATURE = 0.7
ECHO_PROMPT = "Question: What is the boiling point of water at sea level?\nAnswer:"


def _comparable(ag: Agreement, tokens: list, what: str) -> None:
    """A token no token of this tokenizer has the bytes of ends the comparison there (the bytes
    probe reports it); with none compared at all there is nothing to say."""
    if tokens and not ag.records:
        raise Skip(f"no {what} token could be identified by its bytes, so none compared (see the bytes probe)")


def _greedy(ctx: Context, body: dict[str, Any]) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    answer = ctx.post(COMPLETIONS, body)
    tokens = tokens_of(answer["choices"][0], COMPLETIONS)
    ag = against_model(ctx.ref, ctx.ref.prompt_ids(PROMPT), tokens)
    s = stats(ag.diffs())
    figures = {
        "tokens": len(tokens),
        "compared": len(ag.records),
        "unidentified_from": ag.unmapped,
        "abs_diff": s,
        **top_kl(ctx.ref, ag, tokens),
        "not_argmax": [r["index"] for r in ag.records if r["gap"] > ctx.tolerance],
    }
    _comparable(ag, tokens, "greedy")
    problems = []
    values = [r["server"] for r in ag.records if r["server"] is not None]
    if values and all(v == 0.0 for v in values) and s["max"] and s["max"] > ctx.tolerance:
        problems.append(
            f"every greedy token logprob is 0.0, the model's differ by up to {s['max']:.3g} nats "
            "(as speculative decoding did in llama.cpp #27972 and vLLM #17876)"
        )
    elif s["max"] is not None and s["max"] > ctx.tolerance:
        r = ag.first_above(ctx.tolerance)
        hint = (
            f"; mean |Δ| {s['mean']:.3g}: is the server running --model's weights in the same precision?"
            if s["mean"] > 0.5
            else ""
        )
        problems.append(
            f"greedy token {r['index']} ({r['token']!r}): server {fmt(r['server'])}, lmtrace "
            f"{fmt(r['lmtrace'])} (max |Δ| {s['max']:.3g} > tolerance {ctx.tolerance:g}){hint}"
        )
    if figures["not_argmax"]:
        problems.append(f"greedy token {figures['not_argmax'][0]} is not the model's most likely token")
    evidence = {"lmtrace": ag.worst()}
    return problems, figures, {"answer": answer, **evidence}


def _best_temperature(ag: Agreement) -> dict[str, float] | None:
    """The temperature whose distribution best explains the server's numbers (compare's fit)."""
    rows = ag.forced.logits[len(ag.forced.prompt_ids) - 1 :][: len(ag.records)]
    chosen = torch.tensor([r["token_id"] for r in ag.records], dtype=torch.long)
    return fit_temperature(rows, chosen, [r["server"] for r in ag.records]) if ag.records else None


def _sampled(ctx: Context, body: dict[str, Any]) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """A seeded sampled completion: are its numbers the raw distribution's or the processed one's?"""
    answer = ctx.post(COMPLETIONS, body)
    tokens = tokens_of(answer["choices"][0], COMPLETIONS)
    ag = against_model(ctx.ref, ctx.ref.prompt_ids(PROMPT), tokens)
    processed = ag.forced.processed(SAMPLED_TEMPERATURE)
    raw = stats(ag.diffs())
    proc = stats([r["server"] - processed[r["index"]] for r in ag.records if r["server"] is not None])
    fits = "raw" if raw["max"] is not None and raw["max"] <= ctx.tolerance else None
    if fits is None and proc["max"] is not None and proc["max"] <= ctx.tolerance:
        fits = "processed"
    figures = {
        "tokens": len(tokens),
        "compared": len(ag.records),
        "unidentified_from": ag.unmapped,
        "abs_diff_raw": raw,
        "abs_diff_processed": proc,
        "distribution": fits or "neither",
        "best_temperature": _best_temperature(ag),
        **top_kl(ctx.ref, ag, tokens),
    }
    _comparable(ag, tokens, "sampled")
    problems = []
    if fits == "processed":
        problems.append(
            f"the sampled answer's logprobs are those of the processed distribution (temperature "
            f"{SAMPLED_TEMPERATURE}), not the model's raw ones (max |Δ| raw {raw['max']:.3g}, processed "
            f"{proc['max']:.3g}; vLLM #9453; vLLM's --logprobs-mode processed_logprobs does this)"
        )
    elif fits is None and raw["max"] is not None:
        problems.append(
            f"the sampled answer's logprobs fit neither the raw distribution (max |Δ| {raw['max']:.3g}) "
            f"nor the processed one at temperature {SAMPLED_TEMPERATURE} ({fmt(proc['max'])})"
        )
    evidence = {"lmtrace": ag.worst(), "lmtrace_processed": processed[:40]}
    return problems, figures, {"answer": answer, **evidence}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _partly(*runs: dict[str, Any]) -> str:
    """What an answer's unidentifiable tokens left out of the comparison, if anything."""
    cut = [f"{r['compared']} of {r['tokens']}" for r in runs if r["unidentified_from"] is not None]
    return f" (compared {', '.join(cut)} tokens: the rest is not identifiable, see the bytes probe)" if cut else ""


def probe_logprobs(ctx: Context) -> ProbeResult:
    """Greedy and sampled completions: token logprobs against the model's raw ones, per-token |Δ|,
    KL over the returned alternatives, same top-1."""
    greedy_body = ctx.completion(PROMPT)
    sampled_body = ctx.completion(PROMPT, temperature=SAMPLED_TEMPERATURE, seed=7)
    problems, greedy, g_ev = _greedy(ctx, greedy_body)
    sampled_problems, sampled, s_ev = _sampled(ctx, sampled_body)
    problems += sampled_problems
    figures = {"greedy": greedy, "sampled": sampled}
    ok = (
        f"greedy and sampled token logprobs are the model's raw ones: max |Δ| {fmt(greedy['abs_diff']['max'])} "
        f"and {fmt(sampled['abs_diff_raw']['max'])} nats, KL over the top-{TOP_N} mean "
        f"{fmt(greedy['kl_mean'])}, same top-1 {_pct(greedy['same_top1'])}" + _partly(greedy, sampled)
    )
    first_sampled = bool(sampled_problems) and len(sampled_problems) == len(problems)
    body, ev = (sampled_body, s_ev) if first_sampled else (greedy_body, g_ev)
    evidence = ctx.evidence(COMPLETIONS, body, ev.pop("answer"), **ev)
    return verdict("logprobs", problems, ok, figures, evidence)


def probe_echo(ctx: Context) -> ProbeResult:
    """echo=true: the prompt's tokens come first, the first with a null logprob, the others equal
    to teacher forcing."""
    body = ctx.completion(ECHO_PROMPT, echo=True, max_tokens=1, logprobs=1)
    answer = ctx.post(COMPLETIONS, body)
    choice = answer["choices"][0]
    tokens = tokens_of(choice, COMPLETIONS)
    prompt = ctx.ref.prompt_ids(ECHO_PROMPT)
    ids, _ = ctx.ref.ids_of(tokens[: len(prompt)])
    figures: dict[str, Any] = {"prompt_tokens": len(prompt), "returned_tokens": len(tokens)}
    problems = []
    if not str(choice.get("text", "")).startswith(ECHO_PROMPT):
        problems.append("with echo the text does not start with the prompt")
    if ids != prompt:
        shape = "only the generated token's" if len(tokens) <= body["max_tokens"] else "not the prompt's tokens"
        problems.append(
            f"echo returned logprobs for {len(tokens)} tokens where the prompt holds {len(prompt)} (+ "
            f"{body['max_tokens']} generated): {shape} (llama.cpp #27174: lm-evaluation-harness then "
            "scores multiple-choice tasks at chance)"
        )
        return verdict("echo", problems, "", figures, ctx.evidence(COMPLETIONS, body, answer, lmtrace_prompt=prompt))
    model = ctx.ref.forced(prompt, []).prompt_logprobs()
    server = [t.logprob for t in tokens[1 : len(prompt)]]
    diffs = [s - m for s, m in zip(server, model) if s is not None]
    figures.update(first_null=tokens[0].logprob is None, abs_diff=stats(diffs), missing=sum(s is None for s in server))
    bad_offset = offset_problem(choice, len(prompt))
    if bad_offset:
        problems.append(bad_offset)
    if tokens[0].logprob is not None:
        problems.append(f"the first prompt token has logprob {tokens[0].logprob}, expected null (nothing precedes it)")
    if figures["missing"]:
        problems.append(f"{figures['missing']} prompt tokens after the first have a null logprob")
    if diffs and figures["abs_diff"]["max"] > ctx.tolerance:
        worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
        problems.append(
            f"prompt token {worst + 1} ({tokens[worst + 1].text!r}): server {fmt(server[worst])}, "
            f"lmtrace {fmt(model[worst])} (max |Δ| {figures['abs_diff']['max']:.3g})"
        )
    ok = (
        f"the {len(prompt)} prompt tokens come back, the first null, the others equal to teacher forcing "
        f"(max |Δ| {fmt(figures['abs_diff']['max'])})"
    )
    return verdict("echo", problems, ok, figures, ctx.evidence(COMPLETIONS, body, answer, lmtrace_prompt=model))


def offset_problem(choice: dict[str, Any], prompt_n: int) -> str | None:
    """What is wrong with an echo's `text_offset`, or None: each offset where its token's text
    starts in the echoed text (a token that adds no characters, such as a BOS the tokenizer
    added, shares the next token's offset), never going backwards, the first generated token at
    the end of the prompt."""
    lp, text = choice.get("logprobs") or {}, str(choice.get("text", ""))
    offsets, names = lp.get("text_offset"), lp.get("tokens")
    if not isinstance(offsets, list) or not isinstance(names, list) or len(offsets) != len(names):
        return None  # no offsets to check (the chat shape, or a server without them)
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            return (
                f"text_offset goes backwards at token {i} ({offsets[i - 1]} then {offsets[i]}): the offsets "
                "count text the echoed prompt does not hold (a BOS or other special token?)"
            )
    for i, (at, name) in enumerate(zip(offsets[:prompt_n], names[:prompt_n])):
        adds_nothing = (offsets[i + 1] if i + 1 < len(offsets) else len(text)) == at
        whole = isinstance(name, str) and not name.startswith("bytes:") and "\ufffd" not in name
        if whole and not adds_nothing and not text.startswith(name, at):
            shown = text[at : at + 12]
            return f"text_offset of prompt token {i} ({name!r}) is {at}, where the echoed text reads {shown!r}"
    if len(offsets) > prompt_n and offsets[prompt_n] != len(ECHO_PROMPT):
        return f"the first generated token's text_offset is {offsets[prompt_n]}, not the prompt's {len(ECHO_PROMPT)}"
    return None


def probe_chat(ctx: Context) -> ProbeResult:
    """Chat logprobs (content list, bytes) against teacher forcing under the model's chat template."""
    if not ctx.ref.has_chat_template():
        raise Skip(f"{ctx.ref.source} has no chat template: lmtrace cannot say what the server should see")
    body = ctx.chat(MESSAGES, top_logprobs=2)
    answer = ctx.post(CHAT, body)
    choice = answer["choices"][0]
    tokens = tokens_of(choice, CHAT)
    ag = against_model(ctx.ref, ctx.ref.chat_ids(MESSAGES), tokens)
    s = stats(ag.diffs())
    _comparable(ag, tokens, "chat")
    problems = []
    no_bytes = [i for i, t in enumerate(tokens) if t.bytes is None]
    wrong_bytes = [
        r["index"]
        for r in ag.records
        if tokens[r["index"]].bytes is not None and bytes(tokens[r["index"]].bytes) != ctx.ref.bytes_of(r["token_id"])
    ]
    spelled = spellings(ctx.ref, tokens)
    content = str((choice.get("message") or {}).get("content") or "")
    figures = {
        "tokens": len(tokens),
        "compared": len(ag.records),
        "unidentified_from": ag.unmapped,
        "abs_diff": s,
        "no_bytes": len(no_bytes),
        "wrong_bytes": wrong_bytes,
        "content_matches_tokens": content in spelled,
    }
    if s["max"] is not None and s["max"] > ctx.tolerance:
        r = ag.first_above(ctx.tolerance)
        problems.append(
            f"chat token {r['index']} ({r['token']!r}): server {fmt(r['server'])}, lmtrace "
            f"{fmt(r['lmtrace'])} under the chat template (max |Δ| {s['max']:.3g})"
        )
    if no_bytes:
        problems.append(
            f"{len(no_bytes)} chat logprob entries have no bytes (OpenAI's field), first token {no_bytes[0]}"
        )
    if wrong_bytes:
        problems.append(f"chat token {wrong_bytes[0]}'s bytes are not the token's own")
    if ag.unmapped is None and not figures["content_matches_tokens"]:
        problems.append(f"the tokens spell {spelled[0][:80]!r}, the message content is {content[:80]!r}")
    ok = f"{len(ag.records)} chat tokens, bytes right, logprobs equal to teacher forcing (max |Δ| {fmt(s['max'])})"
    ok += _partly(figures)
    evidence = ctx.evidence(CHAT, body, answer, lmtrace=ag.worst())
    return verdict("chat", problems, ok, figures, evidence)
