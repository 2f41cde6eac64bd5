"""The `bytes` probe: tokens that are not whole UTF-8 characters (a Chinese character or an emoji
split across byte-level tokens) must still say which token they are: OpenAI's completions write
them "bytes:\\xe5\\xbe", its chat `bytes` field holds the token's own raw bytes. A server that
writes "" or U+FFFD instead loses the token: a client cannot tell which one was scored."""

from __future__ import annotations

from typing import Any

from lmtrace.comparison.audit.base import Context, spellings, tokens_of, verdict
from lmtrace.comparison.audit.result import ProbeResult
from lmtrace.comparison.parse import Token, token_bytes

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "很久很久以前，"
MESSAGES = [{"role": "user", "content": "Translate into Chinese: Once upon a time"}]


def _check(ctx: Context, path: str, tokens: list[Token], text: str) -> tuple[list[str], dict]:
    lost = [i for i, t in enumerate(tokens) if ctx.ref.id_of(t) is None]
    spelled = spellings(ctx.ref, tokens)
    partial = sum(1 for t in tokens if _partial(token_bytes(t.text, t.bytes)))
    problems = []
    if lost:
        t = tokens[lost[0]]
        shown = "" if t.bytes is None else f", bytes {t.bytes}"
        problems.append(
            f"{path}: {len(lost)} of {len(tokens)} tokens name no token of this tokenizer, first token {lost[0]} "
            f"(token {t.text!r}{shown}): a token that is not whole UTF-8 must carry its own bytes "
            "(OpenAI: 'bytes:\\xNN' in completions, the raw bytes in chat's bytes field)"
        )
    elif text not in spelled:
        problems.append(f"{path}: the tokens' bytes spell {spelled[0][:60]!r}, the text is {text[:60]!r}")
    figures = {"tokens": len(tokens), "unidentified": len(lost), "reported_partial_utf8": partial}
    return problems, figures


def _partial(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def probe_bytes(ctx: Context) -> ProbeResult:
    """A Chinese prompt on /v1/completions and a Chinese answer on chat: every token identifiable
    by its bytes, the bytes spelling the text (the values are the logprobs probe's)."""
    body = ctx.completion(PROMPT, logprobs=1)
    answer = ctx.post(COMPLETIONS, body)
    choice = answer["choices"][0]
    tokens = tokens_of(choice, COMPLETIONS)
    problems, figures = _check(ctx, COMPLETIONS, tokens, str(choice.get("text", "")))
    all_figures: dict[str, Any] = {"completions": figures}
    evidence = ctx.evidence(COMPLETIONS, body, answer)
    if ctx.ref.has_chat_template():
        chat_body = ctx.chat(MESSAGES, top_logprobs=1)
        chat_answer = ctx.post(CHAT, chat_body)
        chat = chat_answer["choices"][0]
        content = str((chat.get("message") or {}).get("content") or "")
        chat_tokens = tokens_of(chat, CHAT)
        chat_problems, all_figures["chat"] = _check(ctx, CHAT, chat_tokens, content)
        if chat_problems and not problems:
            evidence = ctx.evidence(CHAT, chat_body, chat_answer)
        problems += chat_problems
    partial = sum(f["reported_partial_utf8"] for f in all_figures.values())
    ok = f"every token identifiable by its bytes ({partial} of them not whole UTF-8), the bytes spell the text"
    return verdict("bytes", problems, ok, all_figures, evidence)
