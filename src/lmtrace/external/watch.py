"""`lmtrace.watch(model)`: records every forward call of a person's own decoding loop and
explains cache misuse (tokens fed again, positions that do not continue the cache, a cache
reused for another prompt) as `w.problems` and a CacheMisuseWarning."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace.kv import ledger as kv

FIX = "feed only the new tokens: model(input_ids[:, -1:], cache=cache) after the first call"


class CacheMisuseWarning(UserWarning):
    """A decoding loop uses its KV cache in a way that silently changes the logits."""


@dataclass
class Round:
    """One forward call seen by `watch`."""

    index: int
    input_len: int
    cache_len_before: int
    cache_len_after: int
    logits_shape: list[int] | None
    layer_shapes: list[list[int] | None]
    position_start: int | None = None
    # with record=True: the tokens fed (per row) and the cache's bytes after the call
    input_ids: list[list[int]] | None = None
    cache_bytes: int | None = None


@dataclass
class Problem:
    round: int
    kind: str  # "refed_tokens", "positions", "different_prompt"
    message: str
    expected_cache_len: int
    actual_cache_len: int


@dataclass
class _Seen:
    """The sequence (row 0) a cache stands for, as a correct loop would have fed it."""

    tokens: list[int] = field(default_factory=list)


class Watch:
    def __init__(self, model: torch.nn.Module, record: bool = False):
        self.model = model
        self.record = record
        # with record=True: each round's last-position logits, float32 (rows, vocab)
        self.logits: list[torch.Tensor | None] = []
        self.rounds: list[Round] = []
        self.problems: list[Problem] = []
        self._seen: dict[int, _Seen] = {}
        self._pending: dict[str, Any] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> Watch:
        self._handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def ok(self) -> bool:
        return not self.problems

    def _before(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        length = ids.shape[-1] if ids is not None else (embeds.shape[1] if embeds is not None else 0)
        cache = kv.find_cache(kwargs)
        before = kv.seq_length(cache) if cache is not None else 0
        pos = kwargs.get("position_ids")
        self._pending = {
            "ids": ids[0].tolist() if ids is not None else None,
            "len": int(length),
            "before": before,
            "cache": cache,
            "pos": int(pos[0, 0]) if isinstance(pos, torch.Tensor) and pos.numel() else None,
            "mask": kwargs.get("attention_mask"),
            "all_ids": ids.tolist() if self.record and isinstance(ids, torch.Tensor) and ids.dim() == 2 else None,
        }

    def _after(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        p, self._pending = self._pending, {}
        cache = p["cache"] if p["cache"] is not None else _output_cache(output)
        after = kv.seq_length(cache) if cache is not None else 0
        logits = getattr(output, "logits", None)
        r = Round(
            index=len(self.rounds),
            input_len=p["len"],
            cache_len_before=p["before"],
            cache_len_after=after,
            logits_shape=list(logits.shape) if isinstance(logits, torch.Tensor) else None,
            layer_shapes=kv.layer_shapes(cache) if cache is not None else [],
            position_start=p["pos"],
        )
        self.rounds.append(r)
        if self.record:
            self._keep(r, p, cache, logits)
        if cache is not None:
            self._check(r, p, cache)

    def _keep(self, r: Round, p: dict[str, Any], cache: Any, logits: Any) -> None:
        """What a trace of the loop needs: the fed tokens, the cache's bytes, the last position's
        logits (a copy: the output's own tensor may be large and is the loop's to free)."""
        r.input_ids = p.get("all_ids")
        r.cache_bytes = kv.state(cache, layers=False).bytes if cache is not None else None
        last = logits[:, -1, :] if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None
        self.logits.append(last.detach().to(torch.float32, copy=True) if last is not None else None)

    def trace(self, tokenizer: Any, *, row: int = 0, tokens: Any = None, top_logprobs: int = 5) -> Any:
        """The loop as a Trace (needs `watch(model, record=True)`): one step per round, the token
        the loop fed after it (or `tokens`, the loop's own choices, which also covers the last
        round), with its logprob, rank, entropy and alternatives under the round's logits, the
        cache's size after the round, and the problems found, on the step where each starts."""
        from lmtrace.external.watch_trace import build

        return build(self, tokenizer, row=row, tokens=tokens, top_logprobs=top_logprobs)

    def _check(self, r: Round, p: dict[str, Any], cache: Any) -> None:
        seen = self._seen.setdefault(id(cache), _Seen())
        ids, held = p["ids"], seen.tokens
        refed = False
        if r.cache_len_before and ids is not None and held:
            overlap = min(len(ids), len(held))
            if len(ids) > 1 and ids[:overlap] == held[:overlap]:
                refed = True
                expected = len(held) + len(ids) - overlap
                self._report(
                    r,
                    "refed_tokens",
                    expected,
                    f"round {r.index}: fed {len(ids)} tokens, but the cache already holds the first "
                    f"{overlap} of them; it now holds {r.cache_len_after} positions where "
                    f"{expected} were expected",
                )
            elif len(ids) > 1 and ids[0] == held[0]:
                self._report(
                    r,
                    "different_prompt",
                    len(ids),
                    f"round {r.index}: a cache holding {r.cache_len_before} positions of another sequence "
                    f"was reused for a new prompt; it now holds {r.cache_len_after} positions where "
                    f"{len(ids)} were expected (start from a new cache for a new prompt)",
                )
        expected_pos = _expected_position(p["mask"], r.cache_len_before)
        if r.cache_len_before and p["pos"] is not None and p["pos"] != expected_pos:
            self._report(
                r,
                "positions",
                r.cache_len_after,
                f"round {r.index}: position ids start at {p['pos']} but the cache holds "
                f"{r.cache_len_before} positions, so the next position is {expected_pos}",
            )
        if ids is not None:  # the sequence a correct loop would now hold
            seen.tokens = list(ids) if refed else seen.tokens + list(ids)

    def _report(self, r: Round, kind: str, expected: int, text: str) -> None:
        message = f"{text}. Fix: {FIX}." if kind == "refed_tokens" else text + "."
        self.problems.append(Problem(r.index, kind, message, expected, r.cache_len_after))
        warnings.warn(message, CacheMisuseWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """How far up the stack the caller's own code is (past torch's hooks and transformers)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in ("/torch/", "/transformers/", "/lmtrace/watch.py")):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _output_cache(output: Any) -> Any:
    found = getattr(output, "cache", None)
    return found if found is not None else getattr(output, "past_key_values", None)


def _expected_position(mask: Any, before: int) -> int:
    """The next position of row 0: tokens held, less left padding where a mask says so."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= before:
        return int(mask[0, :before].sum())
    return before


def watch(model: torch.nn.Module, record: bool = False) -> Watch:
    """Context manager: `with lmtrace.watch(model) as w: ...` then read `w.rounds` and `w.problems`.
    With `record=True` it also keeps each round's last-position logits (float32, one row per
    sequence: vocab x 4 bytes each) and `w.trace(tokenizer)` turns the loop into a Trace."""
    return Watch(model, record)
