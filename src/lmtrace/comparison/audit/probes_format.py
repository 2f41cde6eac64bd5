"""The probes of counts and cuts: `usage` (token counts equal the tokenizer's), `stop` (a stop
string cuts the text and the logprobs at the same token) and `tokenize` (vLLM's /tokenize and
/detokenize, where the server offers them, equal the tokenizer's)."""

from __future__ import annotations

from typing import Any

from lmtrace.comparison.audit.base import MESSAGES, Context, Skip, token_text, tokens_of, verdict
from lmtrace.comparison.audit.client import HTTPFailure
from lmtrace.comparison.audit.result import ProbeResult
from lmtrace.comparison.parse import Token, token_bytes

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USAGE_PROMPT = "Write one sentence about the sea:"
STOP_PROMPT = "The days of the week are Monday, Tuesday,"
TOKENIZE_TEXTS = ["Hello world", "很久很久以前，🙂 naïve café"]


def _counts(ctx: Context, path: str, body: dict[str, Any], prompt_tokens: int) -> tuple[list[str], dict]:
    answer = ctx.post(path, body)
    tokens = tokens_of(answer["choices"][0], path)
    usage = answer.get("usage")
    expected = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(tokens),
        "total_tokens": prompt_tokens + len(tokens),
    }
    if not isinstance(usage, dict):
        return [f"{path} answered without usage"], {"expected": expected, "usage": usage, "answer": answer}
    wrong = [k for k, v in expected.items() if usage.get(k) != v]
    problems = [
        f"{path}: usage.{k} is {usage.get(k)}, the tokenizer counts {expected[k]}"
        + (" (the tokens the answer's logprobs hold)" if k == "completion_tokens" else "")
        for k in wrong
    ]
    return problems, {"expected": expected, "usage": usage, "answer": answer, "body": body}


def probe_usage(ctx: Context) -> ProbeResult:
    """usage.prompt_tokens is the tokenizer's count of the prompt (the chat template's for chat),
    completion_tokens the tokens generated, total the sum; streamed usage the same."""
    body = ctx.completion(USAGE_PROMPT, logprobs=1)
    problems, seen = _counts(ctx, COMPLETIONS, body, len(ctx.ref.prompt_ids(USAGE_PROMPT)))
    figures: dict[str, Any] = {"completions": {"usage": seen["usage"], "expected": seen["expected"]}}
    evidence = ctx.evidence(COMPLETIONS, body, seen["answer"], expected=seen["expected"])
    if ctx.ref.has_chat_template():
        chat_body = ctx.chat(MESSAGES, top_logprobs=1)
        chat_problems, chat = _counts(ctx, CHAT, chat_body, len(ctx.ref.chat_ids(MESSAGES)))
        figures["chat"] = {"usage": chat["usage"], "expected": chat["expected"]}
        if chat_problems and not problems:
            evidence = ctx.evidence(CHAT, chat_body, chat["answer"], expected=chat["expected"])
        problems += chat_problems
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        streamed = [e["usage"] for e in ctx.client.stream(COMPLETIONS, stream_body) if e.get("usage")]
    except HTTPFailure as e:
        streamed = [f"refused: {e.message()}"]
    figures["streamed"] = streamed[-1] if streamed else None
    if streamed and isinstance(streamed[-1], dict) and streamed[-1] != {**streamed[-1], **seen["expected"]}:
        problems.append(f"streamed usage {streamed[-1]} differs from the tokenizer's counts {seen['expected']}")
    ok = f"usage counts equal the tokenizer's: {seen['expected']}" + ("" if streamed else " (no usage streamed)")
    return verdict("usage", problems, ok, figures, evidence)


def _stop_string(tokens: list[Token], text: str) -> tuple[str, int, str] | None:
    """(a stop string of two consecutive tokens, near the middle of the answer, that first occurs
    where the first of them starts; that token's index; the text before it), or None."""
    datas = [token_bytes(t.text, t.bytes) for t in tokens]
    middle = len(datas) // 2
    for k in sorted(range(1, len(datas) - 2), key=lambda i: abs(i - middle)):  # from the middle out
        head = b"".join(datas[:k]).decode("utf-8", errors="replace")
        try:  # whole characters around the cut, so that text and tokens can end at the same place
            stop = (datas[k] + datas[k + 1]).decode("utf-8")
            before = datas[k - 1].decode("utf-8")
        except UnicodeDecodeError:
            continue
        # a token written "" or U+FFFD holds part of a character: its text is not where it is
        whole = all(datas[k - 1 : k + 2]) and "\ufffd" not in before + stop
        if whole and stop.strip() and text.startswith(head) and text.find(stop) == len(head):
            return stop, k, head
    return None


def probe_stop(ctx: Context) -> ProbeResult:
    """A stop string taken from the greedy answer: the text ends before it, and the logprobs end
    at the same token (the token that completes the stop string, or the last one of the text)."""
    body = ctx.completion(STOP_PROMPT, logprobs=1, max_tokens=max(16, ctx.max_tokens))
    full = ctx.post(COMPLETIONS, body)["choices"][0]
    tokens = tokens_of(full, COMPLETIONS)
    found = _stop_string(tokens, str(full.get("text")))
    if found is None:
        raise Skip(f"the greedy answer {full.get('text')!r} offers no stop string to test")
    stop, k, expected_text = found
    stopped_body = {**body, "stop": [stop]}
    answer = ctx.post(COMPLETIONS, stopped_body)
    choice = answer["choices"][0]
    got = tokens_of(choice, COMPLETIONS)
    problems = []
    if choice.get("finish_reason") != "stop":
        problems.append(f"finish_reason is {choice.get('finish_reason')!r} after the stop string, expected 'stop'")
    if choice.get("text") != expected_text:
        problems.append(
            f"the text is {choice.get('text')!r}, expected the answer cut before {stop!r}: {expected_text!r}"
        )
    same = [token_bytes(t.text, t.bytes) for t in got] == [token_bytes(t.text, t.bytes) for t in tokens[: len(got)]]
    if len(got) > k + 2:
        problems.append(
            f"the logprobs hold {len(got)} tokens, the text ends at token {k} and the stop string at token "
            f"{k + 1}: the logprobs go on past the stop string"
        )
    elif len(got) not in (k, k + 2):
        problems.append(f"the logprobs hold {len(got)} tokens, the text ends at token {k}: the two are cut apart")
    elif not same:
        problems.append("the tokens before the stop string are not the greedy answer's")
    convention = {k: "the text's tokens only", k + 2: "up to the token that completes the stop string"}.get(len(got))
    figures = {"stop": stop, "text_tokens": k, "logprob_tokens": len(got), "logprobs_end": convention}
    evidence = ctx.evidence(
        COMPLETIONS,
        stopped_body,
        answer,
        unstopped_text=full.get("text"),
        unstopped_tokens=[token_text(t) for t in tokens],
    )
    ok = f"stop {stop!r} cuts the text at token {k} and the logprobs {convention}"
    return verdict("stop", problems, ok, figures, evidence)


def _tokenize(ctx: Context, body: dict[str, Any], ours: list[int], what: str, found: list[dict]) -> list[str]:
    """Problems with one /tokenize answer; the evidence of the first is appended to `found`."""
    body = {"model": ctx.served, **body}
    answer = ctx.client.post("/tokenize", body)
    theirs = answer.get("tokens") if isinstance(answer, dict) else None
    problems = []
    if theirs != ours:
        problems.append(f"/tokenize of {what} gives {str(theirs)[:120]}, the tokenizer {str(ours)[:120]}")
    elif answer.get("count", len(ours)) != len(ours):
        problems.append(f"/tokenize of {what}: count {answer.get('count')} for {len(ours)} tokens")
    if problems:
        found.append(ctx.evidence("/tokenize", body, answer, lmtrace_tokens=ours))
    return problems


def probe_tokenize(ctx: Context) -> ProbeResult:
    """vLLM's /tokenize (prompts, and messages through the chat template) and /detokenize."""
    problems: list[str] = []
    found: list[dict] = []
    try:
        for text in TOKENIZE_TEXTS:
            problems += _tokenize(ctx, {"prompt": text}, ctx.ref.prompt_ids(text), repr(text), found)
    except HTTPFailure as e:
        if e.status in (404, 405, 501):
            raise Skip(f"the server has no /tokenize (HTTP {e.status}; vLLM and lmtrace serve offer it)") from None
        raise
    checked = list(TOKENIZE_TEXTS)
    if ctx.ref.has_chat_template():
        problems += _tokenize(ctx, {"messages": MESSAGES}, ctx.ref.chat_ids(MESSAGES), "the chat messages", found)
        checked.append("messages")
    ids = ctx.ref.prompt_ids(TOKENIZE_TEXTS[1])
    body = {"model": ctx.served, "tokens": ids}
    try:
        back = ctx.client.post("/detokenize", body).get("prompt")
        checked.append("detokenize")
        if back != ctx.ref.lm.tokenizer.decode(ids):
            problems.append(f"/detokenize gives {back!r} for the ids of {TOKENIZE_TEXTS[1]!r}")
            found.append(ctx.evidence("/detokenize", body, {"prompt": back}, lmtrace_text=TOKENIZE_TEXTS[1]))
    except HTTPFailure as e:
        if e.status not in (404, 405, 501):
            raise
    ok = f"/tokenize equals the tokenizer on {', '.join(checked)}"
    return verdict("tokenize", problems, ok, {"checked": checked}, found[0] if found else {})
