"""Before any probe: does the server tokenize as the model does? A server that serves another
model is bad input (exit 2), not a failing probe. Asked three ways, each only where the one
before could not tell: /tokenize, an echoed prompt's tokens, usage.prompt_tokens."""

from __future__ import annotations

from typing import Any

from lmtrace.comparison.audit.base import Context
from lmtrace.comparison.audit.client import HTTPFailure
from lmtrace.comparison.audit.connect import refused_key
from lmtrace.comparison.parse import parse_response
from lmtrace.errors import InvalidParameter

TEXT = "The quick brown fox jumps over the lazy dog."


def _mismatch(ctx: Context, how: str, theirs: Any, ours: list[Any]) -> InvalidParameter:
    return InvalidParameter(
        f"model: the server ({ctx.served!r} at {ctx.client.url}) tokenizes {TEXT!r} as {str(theirs)[:100]} ({how}), "
        f"{ctx.ref.source} as {str(ours)[:100]}: it serves another model; pass --model with the weights it serves"
    )


def _post(ctx: Context, path: str, body: dict[str, Any]) -> Any:
    """The answer, or None where the server refuses; a refused key is bad input."""
    try:
        return ctx.client.post(path, body)
    except HTTPFailure as e:
        if e.status in (401, 403):
            raise refused_key(ctx.client.url, ctx.client.api_key, e) from None
        return None


def check_tokenization(ctx: Context) -> dict[str, Any]:
    """{"tokenization": how it was found to match}; raises InvalidParameter when it does not."""
    ours = ctx.ref.prompt_ids(TEXT)
    answer = _post(ctx, "/tokenize", {"model": ctx.served, "prompt": TEXT})
    by_route = answer.get("tokens") if isinstance(answer, dict) else None
    if by_route == ours:
        return {"tokenization": "matches (/tokenize)", "text": TEXT, "tokens": len(ours)}
    answer = _post(ctx, "/v1/completions", ctx.completion(TEXT, echo=True, max_tokens=1, logprobs=1))
    if answer is None:  # echo refused: a plain completion still has tokens and usage
        answer = _post(ctx, "/v1/completions", ctx.completion(TEXT, max_tokens=1, logprobs=1))
    if not isinstance(answer, dict) or not answer.get("choices"):
        raise InvalidParameter(
            f"url: {ctx.client.url} does not answer POST /v1/completions (a text completion "
            f"with logprobs): the audit needs it"
        )
    try:
        tokens = parse_response(answer).tokens
    except (InvalidParameter, KeyError, TypeError):
        tokens = []
    ours_text = [ctx.ref.text_of(i) for i in ours]
    if tokens and tokens[0].logprob is None and len(tokens) > len(ours):  # an echo that holds the prompt
        ids, _ = ctx.ref.ids_of(tokens[: len(ours)])
        if ids != ours:
            raise _mismatch(ctx, "echo", [t.text for t in tokens[: len(ours)]], ours_text)
        return {"tokenization": "matches (echo)", "text": TEXT, "tokens": len(ours)}
    if tokens and ctx.ref.ids_of(tokens[-1:])[1] is not None:
        raise _mismatch(ctx, f"its token {tokens[-1].text!r} is no token of this tokenizer", [], ours_text)
    if by_route is not None:
        raise _mismatch(ctx, "/tokenize", by_route, ours)
    count = (answer.get("usage") or {}).get("prompt_tokens")
    if isinstance(count, int) and count != len(ours):
        raise _mismatch(ctx, "usage.prompt_tokens", f"{count} tokens", f"{len(ours)} tokens")
    if isinstance(count, int):
        return {"tokenization": "matches (usage.prompt_tokens)", "text": TEXT, "tokens": len(ours)}
    return {"tokenization": "not checked (no /tokenize, echo or usage)", "text": TEXT, "tokens": len(ours)}
