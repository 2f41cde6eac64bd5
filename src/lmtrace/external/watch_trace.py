"""`w.trace(tokenizer)`: a watched loop (`lmtrace.watch(model, record=True)`) as a Trace. Its
steps are the loop's own choices under the logits the loop itself got, so a loop that picks the
second most likely token shows rank 2, and a loop that misuses its cache shows the cache's real
size per round and the problem on the step where it starts."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.detokenize import TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.external.from_generate import PADDED_VOCAB, records_of
from lmtrace.external.generation_config import special_ids
from lmtrace.logits.measure import recorded as measure
from lmtrace.model.arch import summarize
from lmtrace.records import Trace
from lmtrace.versions import versions


def _as_list(tokens: Any, row: int) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    tokens = list(tokens)
    if tokens and isinstance(tokens[0], (list, tuple)):
        tokens = list(tokens[row])
    return [int(t) for t in tokens]


def _choices(w: Any, row: int, tokens: Any, prompt: list[int]) -> list[int]:
    """The token the loop chose at each round: as given, or the last token fed in the next round
    (right or wrong, a loop feeds its choice last), which leaves the last round out."""
    rounds = len(w.rounds)
    if tokens is not None:
        chosen = _as_list(tokens, row)
        if len(chosen) == len(prompt) + rounds and chosen[: len(prompt)] == prompt:
            chosen = chosen[len(prompt) :]  # the whole sequence: prompt, then the choices
        if len(chosen) not in (rounds, rounds - 1):
            raise InvalidParameter(
                f"tokens: expected the loop's {rounds} chosen tokens (or the whole sequence), got {len(chosen)}"
            )
        return chosen
    fed = [r.input_ids for r in w.rounds[1:]]
    if any(ids is None or len(ids) <= row or not ids[row] for ids in fed):
        raise InvalidParameter("tokens: the loop fed no token ids (inputs_embeds?); pass tokens=the loop's choices")
    return [ids[row][-1] for ids in fed]


def _logits(w: Any, row: int, steps: int, tokenizer: Any) -> torch.Tensor:
    kept = w.logits[:steps]
    if any(t is None for t in kept):
        raise InvalidParameter("watch: a forward call returned no logits; trace() needs the model's logits")
    if any(t.shape[0] <= row for t in kept):
        raise InvalidParameter(f"row must be below the loop's batch size {kept[0].shape[0]}, got {row}")
    logits = torch.stack([t[row] for t in kept])  # steps x (vocab,) -> (steps, vocab)
    vocab, size = logits.shape[-1], len(tokenizer)
    if size > vocab or vocab - size > PADDED_VOCAB:
        raise InvalidParameter(f"tokenizer: has {size} tokens but the model's logits have {vocab}: not this model's")
    return logits


def _kv(r: Any, expected: int) -> dict[str, Any]:
    """The cache after the round: its real size, and the size a right loop would have here."""
    return {"seq_len": r.cache_len_after, "bytes": r.cache_bytes, "expected_seq_len": expected,
            "input_len": r.input_len}  # fmt: skip


def build(w: Any, tokenizer: Any, *, row: int = 0, tokens: Any = None, top_logprobs: int = 5) -> Trace:
    if not w.record:
        raise InvalidParameter("trace: needs the logits of each round; start the watch with watch(model, record=True)")
    if not w.rounds:
        raise InvalidParameter("trace: the watch saw no forward call of the model")
    first = w.rounds[0].input_ids
    prompt = list(first[row]) if first is not None and len(first) > row else []
    chosen = _choices(w, row, tokens, prompt)
    if not chosen:
        raise InvalidParameter("trace: one round is not a step; pass tokens=the loop's choices to trace it")
    logits = _logits(w, row, len(chosen), tokenizer)
    numbers = measure(logits, None, torch.tensor(chosen, device=logits.device), top_logprobs)
    eos, _ = special_ids(tokenizer, None, w.model)
    end = chosen[-1] in eos
    steps, text = records_of(chosen, numbers, tokenizer, TokenBytes(tokenizer), "stop" if end else "length")
    for i, step in enumerate(steps):
        step.kv = _kv(w.rounds[i], len(prompt) + i)
    for p in w.problems:  # on the step where it starts (a later round's on the last step traced)
        step = steps[min(p.round, len(steps) - 1)]
        step.problems = (step.problems or []) + [{"round": p.round, "kind": p.kind, "message": p.message,
                                                   "expected_cache_len": p.expected_cache_len,
                                                   "actual_cache_len": p.actual_cache_len}]  # fmt: skip
    summary = summarize(w.model.config, w.model).to_dict()
    source = getattr(w.model, "name_or_path", "") or "in-memory"
    return Trace(
        model={"source": source, "config": summary, "dtype": summary["dtype"], "device": summary["device"]},
        params={"max_new_tokens": len(chosen), "top_logprobs": top_logprobs, "settings": "unknown"},
        prompt={"text": tokenizer.decode(prompt), "token_ids": prompt},
        text=text,
        token_ids=chosen,
        finish_reason="stop" if end else "length",
        stop_reason=chosen[-1] if end else None,
        timing={"prompt_tokens": len(prompt), "generated_tokens": len(chosen), "prefill_ms": None,
                "decode_ms": None, "total_ms": None},  # fmt: skip
        versions=versions(),
        steps=steps,
        origin="watch",
        distributions="raw",
    )
