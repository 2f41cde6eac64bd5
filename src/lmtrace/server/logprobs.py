"""Logprobs in OpenAI's shapes, from lmtrace's Steps, and the prompt's own logprobs for `echo`.

Raw by default: a token's `logprob` is under the model's own distribution (float32
log-softmax, temperature 1, nothing filtered), as `Step.logprob`; `sampled=True` gives
`Step.sampled_logprob`, under the processed distribution the token was drawn from. The
alternatives are the raw top-N either way. -inf (a filtered token) becomes OpenAI's -9999.0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmtrace.decode.prefill import PromptRow, prefill_many
from lmtrace.detokenize import TokenBytes, pieces
from lmtrace.logits import measure
from lmtrace.model.lm import LM
from lmtrace.records import Alternative, Step
from lmtrace.records.alternatives import alternatives
from lmtrace.server import observed

FLOOR = -9999.0  # OpenAI's stand-in for a token too unlikely to have a number


def _lp(x: float) -> float:
    return max(x, FLOOR)


def token_str(raw: list[int]) -> str:
    """A token's own text; bytes that are not a whole UTF-8 character become U+FFFD (the
    exact bytes are in `bytes`)."""
    return bytes(raw).decode("utf-8", errors="replace")


def completion_token(raw: list[int]) -> str:
    """A token as /v1/completions names it. That shape has no `bytes` field and uses tokens as
    dictionary keys, so a token that is not whole UTF-8 is written "bytes:\\xe5\\x8f" rather
    than as U+FFFD, which would merge different tokens into one key."""
    data = bytes(raw)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


@dataclass
class PromptToken:
    """A prompt token for `echo`: its text piece and, from the second on, its logprob."""

    token_id: int
    piece: str
    bytes: list[int]
    logprob: float | None
    top: list[Alternative] = field(default_factory=list)


def prompt_tokens(lm: LM, ids: list[int], numbers: measure.Forced) -> list[PromptToken]:
    """The echoed prompt from its teacher-forced numbers (targets 1..len-1, as
    lmtrace.decode.prefill measures them): token i's logprob under the distribution after
    tokens 0..i-1; the first token has none (null), as OpenAI."""
    tb = TokenBytes(lm.tokenizer)
    texts = pieces(lm.tokenizer, ids)
    out = [PromptToken(ids[0], texts[0], list(tb(ids[0])), None)]
    for i, value, alt_ids, alts in zip(range(1, len(ids)), numbers.logprob, numbers.top_ids, numbers.top_logprobs):
        top = alternatives(alt_ids, alts, alts, tb)
        out.append(PromptToken(ids[i], texts[i], list(tb(ids[i])), value, top))
    return out


def prompt_logprobs(lm: LM, ids: list[int], top_n: int) -> list[PromptToken]:
    """One teacher-forced forward over the prompt alone (lmtrace.decode.prefill, as score and
    echo read it), as PromptTokens."""
    (done,) = prefill_many(lm.model, [PromptRow(ids, top_n)], pad_id=lm.pad_token_id)
    return prompt_tokens(lm, ids, done.numbers)


def chat_entry(step: Step, sampled: bool, observe: bool = False) -> dict[str, Any]:
    """One `choices[].logprobs.content[]` item: {token, logprob, bytes, top_logprobs}; with
    `observe`, also the step's observer entries (lmtrace.server.observed)."""
    key = "sampled_logprob" if sampled else "logprob"
    out = {
        "token": token_str(step.bytes),
        "logprob": _lp(getattr(step, key)),
        "bytes": list(step.bytes),
        "top_logprobs": [{"token": a.text, "logprob": _lp(getattr(a, key)), "bytes": list(a.bytes)} for a in step.top],
    }
    if observe:
        out[observed.NAME] = observed.step_entries(step)
    return out


class CompletionLogprobs:
    """`choices[].logprobs` of /v1/completions: {tokens, token_logprobs, top_logprobs,
    text_offset}. Offsets count characters from the start of the prompt, also without echo
    (as OpenAI), so `(prompt + text)[text_offset[i]:]` starts with what token i added. With
    `observe`, also `observed`: each token's observer entries (null for an echoed prompt token;
    lmtrace.server.observed)."""

    def __init__(self, offset: int, observe: bool = False):
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.observed: list[dict[str, Any] | None] | None = [] if observe else None

    def _add(self, raw: list[int], piece: str, lp: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(completion_token(raw))
        self.token_logprobs.append(None if lp is None else _lp(lp))
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(piece)

    def add_prompt(self, tokens: list[PromptToken], text: str | None = None) -> None:
        """The echoed prompt. With its `text`, a token whose piece the text does not go on with
        (a BOS or other special token the tokenizer added) adds no characters: its offset is
        the next token's, so offsets stay those of the tokenizer's own offset mapping."""
        start = self.offset
        for t in tokens:
            top = None if t.logprob is None else _top_dict(t.top, t.bytes, t.logprob, "logprob")
            added = text is not None and not text.startswith(t.piece, self.offset - start)
            self._add(t.bytes, "" if added else t.piece, t.logprob, top)
            if self.observed is not None:
                self.observed.append(None)

    def add_step(self, step: Step, piece: str, sampled: bool) -> None:
        """`piece` is the text the step adds to the answer ("" past a stop string or at EOS)."""
        key = "sampled_logprob" if sampled else "logprob"
        self._add(step.bytes, piece, getattr(step, key), _top_dict(step.top, step.bytes, getattr(step, key), key))
        if self.observed is not None:
            self.observed.append(observed.step_entries(step))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        if self.observed is not None:
            out[observed.NAME] = self.observed
        return out


def _top_dict(top: list[Alternative], own: list[int], own_lp: float, key: str) -> dict[str, float]:
    """The alternatives by text, most likely first, plus the chosen token when it is not among
    them (so up to N+1 entries, as OpenAI)."""
    d = {completion_token(a.bytes): _lp(getattr(a, key)) for a in top}
    d.setdefault(completion_token(own), _lp(own_lp))
    return d
