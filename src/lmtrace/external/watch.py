"""`lmtrace.watch(model)`: records every forward call of a person's own decoding loop and
explains what changes its logits (tokens fed again, the argmax of every position appended, a
cache from an earlier round, positions that do not continue the cache, a cache reused for another
prompt) as `w.problems` and a CacheMisuseWarning, each with the fix for that loop (follow.py)."""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmtrace.external.follow import Loop, positions
from lmtrace.inside.hooks import Hooks
from lmtrace.kv import ledger

PACKAGE = str(Path(__file__).resolve().parents[1])  # lmtrace's own frames are not the user's


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
    time_ms: float | None = None  # the forward call's wall time
    # per row: the tokens this round appended to the loop's sequence (the previous round's choices,
    # or the prompt), and how many leading tokens it fed again
    new_tokens: list[list[int]] | None = None
    refed: int = 0
    starts: bool = False  # the first round of a sequence (the first call, or a new prompt)
    # with record=True: the tokens fed and their attention mask (per row), the cache's bytes after the call
    input_ids: list[list[int]] | None = None
    input_mask: list[list[int]] | None = None
    cache_bytes: int | None = None


@dataclass
class Problem:
    round: int
    kind: str  # refed_tokens, all_positions, stale_cache, positions, different_prompt
    message: str
    expected_cache_len: int
    actual_cache_len: int


class Watch:
    def __init__(self, model: torch.nn.Module, record: bool = False):
        self.model = model
        self.record = record
        # with record=True: each round's last-position logits, float32 (rows, vocab)
        self.logits: list[torch.Tensor | None] = []
        self.rounds: list[Round] = []
        self.problems: list[Problem] = []
        self._loop = Loop()
        self._pending: dict[str, Any] = {}
        self._hooks = Hooks(model)

    def __enter__(self) -> Watch:
        self._hooks.add("model.in", self._before)
        self._hooks.add("model.out", self._after)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.remove()

    @property
    def ok(self) -> bool:
        return not self.problems

    def _before(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        length = ids.shape[-1] if ids is not None else (embeds.shape[1] if embeds is not None else 0)
        cache = ledger.find_cache(kwargs)
        pos = kwargs.get("position_ids")
        self._pending = {
            "rows": ids.tolist() if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None,
            "len": int(length),
            "before": ledger.seq_length(cache) if cache is not None else 0,
            "cache": cache,
            "pos": int(pos[0, 0]) if isinstance(pos, torch.Tensor) and pos.numel() else None,
            "mask": kwargs.get("attention_mask"),
            "started": time.perf_counter(),
        }

    def _after(self, module: Any, args: tuple, output: Any) -> None:
        p, self._pending = self._pending, {}
        cache = p["cache"] if p["cache"] is not None else _output_cache(output)
        after = ledger.seq_length(cache) if cache is not None else 0
        logits = getattr(output, "logits", None)
        r = Round(
            index=len(self.rounds),
            input_len=p["len"],
            cache_len_before=p["before"],
            cache_len_after=after,
            logits_shape=list(logits.shape) if isinstance(logits, torch.Tensor) else None,
            layer_shapes=ledger.layer_shapes(cache) if cache is not None else [],
            position_start=p["pos"],
            time_ms=(time.perf_counter() - p["started"]) * 1000,
        )
        self.rounds.append(r)
        if self.record:
            self._keep(r, p, cache, logits)
        if p["rows"] is not None:
            self._follow(r, p, cache is not None and p["cache"] is not None)
        if isinstance(logits, torch.Tensor) and logits.dim() == 3:  # for the next round: the argmax per position
            self._loop.argmax = logits[0].argmax(-1).tolist() if logits.shape[1] > 1 else None

    def _keep(self, r: Round, p: dict[str, Any], cache: Any, logits: Any) -> None:
        """What a trace of the loop needs: the fed tokens and their mask, the cache's bytes, the last
        position's logits (a copy: the output's own tensor may be large and is the loop's to free)."""
        r.input_ids = p["rows"]
        mask = p["mask"]
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and p["len"]:
            r.input_mask = mask[:, -p["len"] :].tolist()  # (batch, past + fed) -> (batch, fed)
        r.cache_bytes = ledger.state(cache, layers=False).bytes if cache is not None else None
        last = logits[:, -1, :] if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None
        self.logits.append(last.detach().to(torch.float32, copy=True) if last is not None else None)

    def trace(self, tokenizer: Any, *, row: int = 0, tokens: Any = None, top_logprobs: int = 5) -> Any:
        """The loop as a Trace (needs `watch(model, record=True)`): one step per token the loop
        appended to its sequence (any number per round; `tokens`, the loop's whole sequence or its
        choices, also covers the last round), each measured under the logits of the round it was
        chosen after (its last position), with the cache's size after that round and the problems
        found, on the step where each starts."""
        from lmtrace.external.watch_trace import build

        return build(self, tokenizer, row=row, tokens=tokens, top_logprobs=top_logprobs)

    def _follow(self, r: Round, p: dict[str, Any], has_cache: bool) -> None:
        fed = self._loop.feed(r.index, p["rows"], r.cache_len_before, r.cache_len_after, has_cache)
        r.new_tokens, r.refed, r.starts = fed.new, fed.refed, fed.starts
        found = list(fed.findings)
        expected_pos = _expected_position(p["mask"], r.cache_len_before)
        if r.cache_len_before and p["pos"] is not None and p["pos"] != expected_pos:
            found.append(positions(r.index, p["pos"], expected_pos, r.cache_len_before, r.cache_len_after))
        for f in found:
            self.problems.append(Problem(r.index, f.kind, f.message + ".", f.expected, r.cache_len_after))
            warnings.warn(f.message + ".", CacheMisuseWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """How far up the stack the caller's own code is (past torch's hooks and transformers)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(PACKAGE) or any(part in name for part in ("/torch/", "/transformers/"))):
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
