"""What every probe shares: the context (client, oracle, served name, tolerance), request bodies
with the audit's defaults, reading the logprobs out of an answer, and the evidence of a failure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmtrace.comparison.audit.client import Client
from lmtrace.comparison.audit.reference import Reference
from lmtrace.comparison.audit.result import ProbeResult
from lmtrace.comparison.parse import Token, parse_response, token_bytes

TOP_N = 5  # alternatives asked for per token
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


class Skip(Exception):
    """The server does not offer what the probe needs; the message says what and why."""


@dataclass
class Context:
    client: Client
    ref: Reference
    served: str  # the model id the requests name
    tolerance: float  # nats: the largest |Δ logprob| that still counts as equal
    max_tokens: int = 12

    def completion(self, prompt: Any, **fields: Any) -> dict[str, Any]:
        """A /v1/completions body: greedy, logprobs of TOP_N alternatives, unless `fields` say otherwise."""
        body = {"model": self.served, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}
        return {**body, "logprobs": TOP_N, **fields}

    def chat(self, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        body = {"model": self.served, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0}
        return {**body, "logprobs": True, "top_logprobs": TOP_N, **fields}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.client.post(path, body)
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list) or not answer["choices"]:
            raise Skip(f"POST {path} answered without choices: {str(answer)[:200]}")
        return answer

    def evidence(self, path: str, body: dict[str, Any], response: Any = None, **extra: Any) -> dict[str, Any]:
        """The request as sent (JSON and curl), what came back, and lmtrace's side (`extra`)."""
        out: dict[str, Any] = {
            "request": {"method": "POST", "url": self.client.url + path, "body": body},
            "curl": self.client.curl(path, body),
        }
        if response is not None:
            out["response"] = response
        return {**out, **extra}


def tokens_of(choice: dict[str, Any], path: str) -> list[Token]:
    """The logprob tokens of one choice (completions or chat shape); Skip when there are none."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        raise Skip(f"POST {path} answered logprobs {logprobs!r}: the server returns no logprobs")
    return parse_response({"choices": [choice]}).tokens


def passed(name: str, detail: str, figures: dict[str, Any]) -> ProbeResult:
    return ProbeResult(name, "pass", detail, figures)


def failed(name: str, detail: str, figures: dict[str, Any], evidence: dict[str, Any]) -> ProbeResult:
    return ProbeResult(name, "fail", detail, figures, evidence)


def verdict(name: str, problems: list[str], ok: str, figures: dict[str, Any], evidence: dict[str, Any]) -> ProbeResult:
    """Pass with `ok` when no problem was found, else fail naming the first (and how many more)."""
    if not problems:
        return passed(name, ok, figures)
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    figures = {**figures, "problems": problems}
    return failed(name, problems[0] + more, figures, evidence)


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def token_text(tok: Token) -> str:
    """A returned token's text: its bytes where the server gave them, 'bytes:\\xNN' decoded."""
    return token_bytes(tok.text, tok.bytes).decode("utf-8", errors="replace")


def spellings(ref: Reference, tokens: list[Token]) -> tuple[str, str]:
    """The text the tokens spell, decoded as a server decodes (invalid bytes become U+FFFD): with
    the special tokens' text but not an end token's (lmtrace, transformers' decode), and without
    any special token (vLLM's skip_special_tokens). A server's text is one of the two."""
    datas = [(ref.id_of(t), token_bytes(t.text, t.bytes)) for t in tokens]
    kept = b"".join(b for i, b in datas if i not in ref.end)
    plain = b"".join(b for i, b in datas if i not in ref.special)
    return kept.decode("utf-8", errors="replace"), plain.decode("utf-8", errors="replace")
