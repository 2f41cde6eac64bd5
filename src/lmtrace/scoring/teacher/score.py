"""Teacher-forced scoring: how likely a given text is under the model, token by token.

One uncached forward pass per window. A text longer than the window is scored with a sliding
window: windows start `stride` tokens apart, and each window scores only the tokens the previous
one did not reach, so every token is scored exactly once, with at least `window - stride` tokens
of context (all of them while the text fits in the first window)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace.decode.prefill import PromptRow, prefill_many
from lmtrace.detokenize import TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.logits import forced, measure
from lmtrace.model.lm import LM
from lmtrace.params import MAX_TOP_LOGPROBS, check_integer
from lmtrace.records import SCHEMA_VERSION, TokenScore
from lmtrace.versions import versions

FALLBACK_WINDOW = 2048  # for a model whose config does not say its context length

Item = str | tuple[str, str]  # what a list to score holds: a text, or a (prompt, continuation) pair


def resolve_window(model, window: int | None, stride: int | None) -> tuple[int, int]:
    """(window, stride): the window defaults to the model's context, the stride to half of it."""
    context = getattr(model.config, "max_position_embeddings", None) or FALLBACK_WINDOW
    w = context if window is None else check_integer("window", window, low=2, high=context)
    s = max(1, w // 2) if stride is None else check_integer("stride", stride, low=1, high=w - 1)
    return w, s


def spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """[(begin, end, first_target)]: forward ids[begin:end] and score ids[first_target:end]."""
    out, begin, reached = [], 0, 1  # the token at position 0 has no context: never a target
    while True:
        end = min(begin + window, n)
        out.append((begin, end, max(reached, begin + 1)))
        if end >= n:
            return out
        reached, begin = end, begin + stride


def forward_windows(model, ids: Sequence[int], first: int, window: int, stride: int) -> Iterator[tuple[int, Any]]:
    """(t, logits (k, vocab)) where the rows predict ids[t : t + k], for every target from
    max(first, 1) on, in order; windows holding no such target are skipped."""
    device = model.device
    for begin, end, target in spans(len(ids), window, stride):
        target = max(target, first)
        if target >= end:
            continue
        chunk = torch.tensor([list(ids[begin:end])], dtype=torch.long, device=device)  # (1, end - begin)
        keep = end - target + 1  # the positions target-1 .. end-1; the last predicts past the window
        out = model(input_ids=chunk, use_cache=False, logits_to_keep=keep)
        yield target, out.logits[0, :-1, :]  # (keep, vocab) -> (keep - 1, vocab)


@dataclass
class ScoreResult:
    """A scored text: one TokenScore per token, and the totals over the scored ones."""

    model: dict[str, Any]
    text: str  # the scored text (with a prompt: the continuation)
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    tokens: list[TokenScore]
    total_logprob: float
    perplexity: float | None  # exp of the mean negative logprob of the scored tokens
    bits_per_byte: float | None  # -total_logprob / ln 2 / scored_bytes
    scored_tokens: int
    scored_bytes: int  # the raw bytes of the scored tokens
    window: int
    stride: int
    timing: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tokens"}
        d["tokens"] = [t.to_dict() for t in self.tokens]
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScoreResult:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k != "tokens" and k in d}
        return cls(**fields, tokens=[TokenScore.from_dict(t) for t in d["tokens"]])


def encode_pair(lm: LM, text: str | None, prompt: str | None, continuation: str | None) -> tuple[list[int], int]:
    """(token ids, index of the first token to report). A prompt is encoded as generate does;
    the continuation is encoded on its own, without special tokens, and appended."""
    tok = lm.tokenizer
    if text is not None:
        if prompt is not None or continuation is not None:
            raise InvalidParameter("text: give a text, or a prompt and a continuation, not both")
        ids = list(tok(text)["input_ids"])
        if not ids:
            raise InvalidParameter(f"text must contain at least one token, got {text!r}")
        return ids, 0
    if prompt is None or continuation is None:
        missing = "prompt" if prompt is None else "continuation"
        raise InvalidParameter(f"{missing}: none given (pass a text, or both a prompt and a continuation)")
    head = list(tok(prompt)["input_ids"])
    tail = list(tok(continuation, add_special_tokens=False)["input_ids"])
    if not tail:
        raise InvalidParameter(f"continuation must contain at least one token, got {continuation!r}")
    return head + tail, len(head)


def _result(lm: LM, item: tuple, ids: list[int], first: int, numbers: measure.Forced, ws: tuple, ms: float, tb):
    text, prompt, continuation = item
    tokens = forced.token_scores(lm.tokenizer, ids, first, numbers, tb)
    scored = [t for t in tokens if t.logprob is not None]
    total = math.fsum(t.logprob for t in scored)
    nbytes = sum(len(t.bytes) for t in scored)
    return ScoreResult(
        model=lm.record(),
        text=text if text is not None else continuation,
        prompt=prompt,
        prompt_token_ids=ids[:first],
        token_ids=ids[first:],
        tokens=tokens,
        total_logprob=total,
        perplexity=math.exp(-total / len(scored)) if scored else None,
        bits_per_byte=-total / math.log(2) / nbytes if nbytes else None,
        scored_tokens=len(scored),
        scored_bytes=nbytes,
        window=ws[0],
        stride=ws[1],
        timing={"total_ms": ms, "tokens_per_s": len(scored) / (ms / 1000) if ms > 0 and scored else None},
        versions=versions(),
    )


def _windowed(lm: LM, ids: list[int], first: int, ws: tuple[int, int], top_n: int) -> measure.Forced:
    numbers = measure.Forced()
    for t, rows in forward_windows(lm.model, ids, first, *ws):
        numbers.extend(measure.targets(rows, torch.tensor(ids[t : t + rows.shape[0]]), top_n))
    return numbers


def score(
    lm: LM,
    text: str | Sequence[Item] | None = None,
    *,
    prompt: str | None = None,
    continuation: str | None = None,
    top_logprobs: int = 5,
    window: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
) -> ScoreResult | list[ScoreResult]:
    """Scores `text` (its first token has no logprob), or `continuation` conditioned on
    `prompt` (only the continuation's tokens are scored), teacher-forced. A list of texts (or
    of (prompt, continuation) pairs) is scored in padded batches of `batch_size`, grouped by
    length (score_batch), and gives a list of results in its order."""
    if isinstance(text, (list, tuple)):
        if prompt is not None or continuation is not None:
            raise InvalidParameter("text: a list of texts takes no prompt or continuation (give pairs in the list)")
        return score_batch(lm, text, batch_size=batch_size, top_logprobs=top_logprobs, window=window, stride=stride)
    check_integer("top_logprobs", top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
    ws = resolve_window(lm.model, window, stride)
    ids, first = encode_pair(lm, text, prompt, continuation)
    started = time.perf_counter()
    with torch.inference_mode():
        numbers = _windowed(lm, ids, first, ws, top_logprobs)
    ms = (time.perf_counter() - started) * 1000
    return _result(lm, (text, prompt, continuation), ids, first, numbers, ws, ms, TokenBytes(lm.tokenizer))


def _batched(lm: LM, batch: list[tuple[list[int], int]], top_n: int) -> list[measure.Forced]:
    """Sequences that fit in one window, in one padded forward (lmtrace.decode.prefill, the
    server's path too): padding is masked out of every scored position."""
    rows = [PromptRow(ids, top_n, first) for ids, first in batch]
    done = prefill_many(lm.model, rows, pad_id=lm.pad_token_id, max_rows=len(rows), max_tokens=sys.maxsize)
    return [d.numbers for d in done]


def _triple(index: int, item: Item) -> tuple[str | None, str | None, str | None]:
    """(text, prompt, continuation) of one item of score_batch."""
    if isinstance(item, str):
        return item, None, None
    if isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) for x in item):
        return None, item[0], item[1]
    raise InvalidParameter(f"items[{index}] must be a text or a (prompt, continuation) pair, got {item!r}")


def _groups(lengths: list[int], batch_size: int, window: int) -> list[list[int]]:
    """Indices in batches: shortest first (a batch pads to its longest member, so similar
    lengths waste less), at most `batch_size` and `window` padded tokens each (the logits of
    one full window bound the memory); a text longer than the window goes alone."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        fits = groups and lengths[i] <= window and len(groups[-1]) < batch_size
        if fits and (len(groups[-1]) + 1) * lengths[i] <= window:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def score_batch(
    lm: LM,
    items: Sequence[Item],
    *,
    batch_size: int = 8,
    top_logprobs: int = 5,
    window: int | None = None,
    stride: int | None = None,
    on_result: Callable[[int, ScoreResult], None] | None = None,
) -> list[ScoreResult]:
    """Scores many texts (a str) or (prompt, continuation) pairs, `batch_size` at a time in one
    padded forward pass; a text longer than the window is scored alone with the sliding window.
    Results come back in the order of `items`; `on_result(i, result)` is called as each is done."""
    check_integer("batch_size", batch_size, low=1)
    check_integer("top_logprobs", top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
    ws = resolve_window(lm.model, window, stride)
    triples = [_triple(i, it) for i, it in enumerate(items)]
    encoded = [encode_pair(lm, *t) for t in triples]  # every item is checked before any forward
    tb = TokenBytes(lm.tokenizer)
    results: list[ScoreResult | None] = [None] * len(items)
    groups = _groups([len(ids) for ids, _ in encoded], batch_size, ws[0])
    for group in groups:
        started = time.perf_counter()
        with torch.inference_mode():
            if len(encoded[group[0]][0]) > ws[0]:
                numbers = [_windowed(lm, *encoded[group[0]], ws, top_logprobs)]
            else:
                numbers = _batched(lm, [encoded[i] for i in group], top_logprobs)
        ms = (time.perf_counter() - started) * 1000 / len(group)  # the batch's time, shared evenly
        for i, n in zip(group, numbers):
            results[i] = _result(lm, triples[i], *encoded[i], n, ws, ms, tb)
            if on_result is not None:
                on_result(i, results[i])
    return results  # type: ignore[return-value]
