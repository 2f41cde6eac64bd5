"""A vLLM RequestOutput in the shape of an OpenAI chat response's `logprobs.content` (token,
logprob, bytes, top_logprobs): vLLM's own numbers in its engine's logprobs mode, each token's
exact bytes from lmtrace's tokenizer table. `lmtrace compare` reads it as it reads any engine's
response; its verdict says which distribution the numbers are from."""

from __future__ import annotations

from typing import Any

from lmtrace.detokenize import TokenBytes


def _entry(tb: TokenBytes, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tb.text(token_id), "logprob": max(logprob, -9999.0), "bytes": list(tb(token_id))}


def chat_response(result: Any, tokenizer: Any, prompt: str | None = None) -> dict[str, Any]:
    """{"request": {"prompt"}, "response": {"choices": [{"logprobs": {"content": [...]}}]}}."""
    tb = TokenBytes(tokenizer)
    output = result.outputs[0]
    content = []
    for token, numbers in zip(output.token_ids, output.logprobs or []):
        item = _entry(tb, token, numbers[token].logprob)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in numbers.items() if lp.rank is not None)
        item["top_logprobs"] = [_entry(tb, t, lp) for _, t, lp in ranked]
        content.append(item)
    text = tokenizer.decode(list(output.token_ids))
    response = {"choices": [{"index": 0, "text": text, "logprobs": {"content": content}}]}
    return {"request": {"prompt": prompt}, "response": response} if prompt is not None else response
