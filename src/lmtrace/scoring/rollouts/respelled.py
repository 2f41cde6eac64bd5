"""A completion re-encoded from its text (`retokenized`, detail `completion: positions ...`): the
pipeline decoded the engine's ids to text and encoded that text again ('ban'+'n' became
'b'+'ann': the same text, the same number of ids), keeping the engine's logprobs. The engine's own
split is found from those logprobs: position by position, among the tokens whose bytes begin the
text still to spell, the one whose teacher-forced logprob is nearest the engine's (the record's
own id while it fits). The split found is then judged as every cause is: its processed logprobs,
batched, must fit the engine's at most FIT times the record's own fit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from lmtrace.detokenize import TokenBytes
from lmtrace.kv import ledger
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.scoring.rollouts import causes, computed, tokens
from lmtrace.scoring.rollouts.rollout import Rollout

SHOWN = 12  # changed positions written in the detail (all of them are in the evidence)


class Spellings:
    """The tokenizer's vocabulary by its tokens' bytes (special tokens left out): which ids
    spell the first bytes of a text."""

    def __init__(self, tokenizer: Any):
        token_bytes = TokenBytes(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(len(tokenizer)):
            if token_id not in special:
                b = token_bytes(token_id)
                if b:
                    self.by_bytes.setdefault(b, []).append(token_id)
        self.longest = max((len(b) for b in self.by_bytes), default=0)
        self.bytes_of = token_bytes

    def text(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.bytes_of(t) for t in ids)

    def starting(self, rest: bytes) -> list[int]:
        """The ids whose bytes are a beginning of `rest`."""
        out: list[int] = []
        for n in range(1, min(len(rest), self.longest) + 1):
            out.extend(self.by_bytes.get(rest[:n], ()))
        return out


def _row_logprobs(logits: torch.Tensor, candidates: list[int], params: SamplingParams) -> list[float]:
    """Processed logprobs of `candidates` under one row of logits (vocab,)."""
    rows = logits[None].expand(len(candidates), -1)  # (candidates, vocab)
    return _row_logprobs_of(rows, candidates, params)


def _row_logprobs_of(rows: torch.Tensor, ids: list[int], params: SamplingParams) -> list[float]:
    """Processed logprob of ids[k] under rows[k] (len(ids), vocab)."""
    return tokens.raw_and_processed(rows, torch.tensor(ids, device=rows.device), params)[1].tolist()


class _Forced:
    """The prompt and the ids taken so far in a cache; each feed returns the distributions after
    the ids it gave (a run the record spells is fed whole, then cut back where it stops fitting)."""

    def __init__(self, model: Any):
        self.model, self.cache = model, ledger.new_cache(model, croppable=True)

    def feed(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), vocab) float32 logits: row k is the distribution after ids[k]."""
        if not ids:
            return torch.empty(0)
        out = self.model(
            input_ids=torch.tensor([ids], device=self.model.device), **ledger.cache_kwargs(self.model, self.cache)
        )
        return out.logits[0].float()

    def held(self) -> int:
        return ledger.seq_length(self.cache)

    def cut(self, length: int) -> None:
        ledger.crop(self.cache, length)


def _own_run(
    forced: _Forced,
    row: torch.Tensor,
    ids: list[int],
    engine: Sequence[float],
    params: SamplingParams,
    tolerance: float,
) -> tuple[int, list[float], torch.Tensor | None]:
    """The record's own `ids` from here, as far as each fits the engine within `tolerance`:
    (how many fit, their gaps, the distribution after them; None at the end)."""
    base = forced.held()
    rows = torch.cat([row[None], forced.feed(ids[:-1])]) if len(ids) > 1 else row[None]  # (len(ids), vocab)
    gaps = causes.gaps(engine, _row_logprobs_of(rows, ids, params))
    fitting = next((k for k, g in enumerate(gaps) if g > tolerance), len(gaps))
    forced.cut(base + fitting)
    return fitting, gaps[:fitting], rows[fitting] if fitting < len(ids) else None


def engine_split(lm: LM, rollout: Rollout, params: SamplingParams, spell: Spellings, budget: float) -> list[int] | None:
    """The split of the completion's text whose logprobs follow the engine's; None when no split
    of the same number of ids spells the text, or when the gaps of the path taken add up past
    `budget` (the fit the verdict needs times the tokens: it cannot pass). Where the text is
    aligned with the record's, its own ids are taken in one forward while each fits within the
    mean gap the budget allows; elsewhere the candidates are weighed one token at a time."""
    record, engine = rollout.completion_ids, rollout.logprobs
    n, tolerance = len(record), budget / max(len(record), 1)
    rest, chosen, spent = spell.text(record), [], 0.0
    with torch.inference_mode():
        forced = _Forced(lm.model)
        row: torch.Tensor | None = forced.feed(list(rollout.prompt_ids))[-1]  # (vocab,): before the first id
        while row is not None:
            j = len(chosen)
            if rest == spell.text(record[j:]):
                fitting, gaps, row = _own_run(forced, row, record[j:], engine[j:], params, tolerance)
                spent += sum(gaps)
                chosen += record[j : j + fitting]
                rest = rest[len(spell.text(record[j : j + fitting])) :]
                if row is None:
                    break
                j = len(chosen)
            candidates = spell.starting(rest) if j < n - 1 else spell.by_bytes.get(rest, [])
            if not candidates:
                return None
            gaps = causes.gaps([engine[j]] * len(candidates), _row_logprobs(row, candidates, params))
            best = min(range(len(candidates)), key=lambda k: (gaps[k], candidates[k] != record[j]))
            spent += gaps[best]
            if spent > budget:
                return None
            chosen.append(candidates[best])
            rest = rest[len(spell.bytes_of(candidates[best])) :]
            row = forced.feed([candidates[best]])[-1] if j < n - 1 else None
    return chosen if not rest and spent <= budget else None


def retokenized(
    lm: LM,
    rollouts: Sequence[Rollout],
    todo: Sequence[int],
    params: Sequence[SamplingParams],
    aligned: dict[int, float],
) -> dict[int, dict[str, Any]]:
    """i -> a `retokenized` cause (detail: the completion's changed positions) for the rollouts
    whose engine logprobs fit another split of their completion's text."""
    if not todo:
        return {}
    spell = Spellings(lm.tokenizer)
    found: dict[int, Rollout] = {}
    for i in todo:
        r = rollouts[i]
        split = engine_split(lm, r, params[i], spell, causes.FIT * aligned[i] * len(r.completion_ids))
        if split is not None and split != r.completion_ids:
            found[i] = replace(r, completion_ids=split)
    if not found:
        return {}
    order = list(found)
    values = computed.processed(lm, [found[i] for i in order], [params[i] for i in order])
    out = {}
    for i, v in zip(order, values):
        got = causes.fit(rollouts[i].logprobs, v)
        if got <= causes.FIT * aligned[i]:
            out[i] = _cause(rollouts[i].completion_ids, found[i].completion_ids, aligned[i], got)
    return out


def _cause(record: list[int], engine: list[int], aligned: float, got: float) -> dict[str, Any]:
    changed = [k for k, (a, b) in enumerate(zip(record, engine)) if a != b]
    shown = ", ".join(str(k) for k in changed[:SHOWN]) + (", ..." if len(changed) > SHOWN else "")
    evidence = {
        "aligned_fit": aligned,
        "retokenized_fit": got,
        "positions": changed,
        "record_ids": [record[k] for k in changed],
        "engine_ids": [engine[k] for k in changed],
        "ids_matching": 1 - len(changed) / len(record),
    }
    return causes.cause("retokenized", f"completion: positions {shown}", evidence)
