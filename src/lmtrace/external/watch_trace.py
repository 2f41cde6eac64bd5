"""`w.trace(tokenizer)`: a watched loop (`lmtrace.watch(model, record=True)`) as a Trace. Its
steps are the tokens the loop itself appended to its sequence, any number per round, each under
the logits of the round it was chosen after (the last position's), so a loop that picks the second
most likely token shows rank 2, its text is exactly the loop's, and a loop that misuses its cache
shows the cache's real size per round and the problem on the step where it starts."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.detokenize import TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.external.from_generate import PADDED_VOCAB, records_of
from lmtrace.external.generation_config import special_ids
from lmtrace.logits.measure import recorded as measure
from lmtrace.model.arch import summarize
from lmtrace.model.lm import model_name, model_record
from lmtrace.records import Step, Trace
from lmtrace.records.timing import timing
from lmtrace.records.traces import new_trace
from lmtrace.stops import finish_reason


def _as_list(tokens: Any, row: int) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    tokens = list(tokens)
    if tokens and isinstance(tokens[0], (list, tuple)):
        tokens = list(tokens[row])
    return [int(t) for t in tokens]


def _kept(r: Any, row: int) -> list[int]:
    """The tokens round `r` appended to row `row`'s sequence, less those its mask says are padding."""
    new = list(r.new_tokens[row]) if r.new_tokens is not None and len(r.new_tokens) > row else []
    mask = r.input_mask[row][len(r.input_mask[row]) - len(new) :] if r.input_mask else [1] * len(new)
    return [t for t, m in zip(new, mask) if m]


def _sequence(w: Any) -> list[Any]:
    """The rounds of the first sequence the watch saw (a later round that starts a new prompt ends it)."""
    rounds = list(w.rounds)
    later = next((k for k, r in enumerate(rounds) if k and r.starts), len(rounds))
    return rounds[:later]


def _given(tokens: Any, row: int, first: Any, prompt: list[int], known: list[int]) -> list[int]:
    """The loop's choices from `tokens`: its whole sequence (left padding and all, or without), or
    its choices alone; they must agree with what the loop fed back."""
    given = _as_list(tokens, row)
    raw = list(first.input_ids[row]) if first.input_ids is not None and len(first.input_ids) > row else prompt
    for head in (raw, prompt):
        if len(given) >= len(head) and given[: len(head)] == head and len(given) - len(head) >= len(known):
            given = given[len(head) :]
            break
    if given[: len(known)] != known[: len(given)]:
        at = next(k for k, (a, b) in enumerate(zip(given, known)) if a != b)
        raise InvalidParameter(
            f"tokens: expected the loop's whole sequence ({len(prompt)} prompt tokens, then its choices) or its "
            f"choices ({len(known)} of them fed back to the model, then the last round's), got {len(given)} tokens "
            f"that differ from what the loop fed at choice {at}"
        )
    return given


def _choices(w: Any, rounds: list[Any], row: int, tokens: Any, prompt: list[int]) -> list[tuple[int, int]]:
    """(token, the round whose logits it was chosen from) for each token the loop appended: what
    the next round fed (any number of tokens), and for the last round, the rest of `tokens`."""
    if any(r.new_tokens is None for r in rounds):
        raise InvalidParameter("tokens: the loop fed no token ids (inputs_embeds?); pass tokens=the loop's choices")
    known = [(t, k) for k, r in enumerate(rounds[1:]) for t in _kept(r, row)]
    if tokens is None:
        return known
    given = _given(tokens, row, rounds[0], prompt, [t for t, _ in known])
    last = len(rounds) - 1
    return [(t, known[i][1] if i < len(known) else last) for i, t in enumerate(given)]


def _logits(w: Any, row: int, which: list[int], tokenizer: Any) -> torch.Tensor:
    kept = [w.logits[k] for k in which]
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
            "input_len": r.input_len, "round": r.index}  # fmt: skip


def _until_end(chosen: list[tuple[int, int]], eos: set[int]) -> list[tuple[int, int]]:
    """A row's choices up to its first end token (a batch keeps feeding a finished row)."""
    end = next((i for i, (t, _) in enumerate(chosen) if t in eos), None)
    return chosen if end is None else chosen[: end + 1]


def build(w: Any, tokenizer: Any, *, row: int = 0, tokens: Any = None, top_logprobs: int = 5) -> Trace:
    if not w.record:
        raise InvalidParameter("trace: needs the logits of each round; start the watch with watch(model, record=True)")
    if not w.rounds:
        raise InvalidParameter("trace: the watch saw no forward call of the model")
    rounds = _sequence(w)
    first = rounds[0]
    if first.new_tokens is not None and len(first.new_tokens) <= row:
        raise InvalidParameter(f"row must be below the loop's batch size {len(first.new_tokens)}, got {row}")
    prompt = _kept(first, row) if first.new_tokens is not None else []
    eos, _ = special_ids(tokenizer, None, w.model)
    chosen = _until_end(_choices(w, rounds, row, tokens, prompt), set(eos))
    if not chosen:
        raise InvalidParameter("trace: one round is not a step; pass tokens=the loop's choices to trace it")
    ids = [t for t, _ in chosen]
    logits = _logits(w, row, [k for _, k in chosen], tokenizer)
    numbers = measure(logits, None, torch.tensor(ids, device=logits.device), top_logprobs)
    end = ids[-1] in eos
    decoded = records_of(ids, numbers, tokenizer, TokenBytes(tokenizer), end)
    steps = decoded[0]
    starts: dict[int, int] = {}
    for i, (step, (_, k)) in enumerate(zip(steps, chosen)):
        step.kv = _kv(rounds[k], len(prompt) + i - sum(1 for _, j in chosen[:i] if j == k))
        first_of_round = starts.setdefault(k, i) == i
        step.time_ms = rounds[k].time_ms if first_of_round else None
    for p in w.problems:  # on the first step chosen after the round where it starts (else the last step)
        at = next((starts[k] for k in sorted(starts) if k >= p.round), len(steps) - 1)
        step = steps[at]
        step.problems = (step.problems or []) + [{"round": p.round, "kind": p.kind, "message": p.message,
                                                   "expected_cache_len": p.expected_cache_len,
                                                   "actual_cache_len": p.actual_cache_len}]  # fmt: skip
    return _trace(w, tokenizer, prompt, ids, decoded, rounds[: max(k for _, k in chosen) + 1], top_logprobs, end)


def _trace(
    w: Any,
    tokenizer: Any,
    prompt: list[int],
    ids: list[int],
    decoded: tuple[list[Step], str],
    rounds: list[Any],
    top_logprobs: int,
    end: bool,
) -> Trace:
    """The Trace of the watched loop's chosen tokens `ids`: `decoded` their (steps, text), as
    records_of gives them; `rounds` the forward calls up to the last step's."""
    steps, text = decoded
    times = [r.time_ms for r in rounds]
    return new_trace(
        steps,
        text=text,
        finish_reason=finish_reason(end, False, True, openai=True),
        stop_reason=ids[-1] if end else None,
        model=model_record(model_name(w.model), summarize(w.model.config, w.model).to_dict()),
        params={"max_new_tokens": len(ids), "top_logprobs": top_logprobs, "settings": "unknown"},
        prompt={"text": tokenizer.decode(prompt), "token_ids": prompt},
        timing=timing(times, len(prompt), len(ids), rounds=len(rounds)),
        origin="watch",
        distributions="raw",
    )
