"""The explicit decoding loop: one prefill forward over the prompt, then one forward per step
that feeds only the new token and the KV cache. No printing, no files."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from lmtrace import forced, inside, kv, kvsize, sampling, waterfall
from lmtrace.errors import InvalidParameter
from lmtrace.params import SamplingParams

# on_token(row, token_id) -> True when the row must stop (a stop string was completed)
TokenHook = Callable[[int, int], bool]


@dataclass
class BatchStep:
    """Numbers for one step of every row in the batch (lists indexed by row)."""

    index: int
    token_ids: list[int]
    active: list[bool]  # rows that were still generating at this step
    finish: list[str | None]  # "eos", "stop" or "length" where a row ends at this step
    logprob: list[float]
    sampled_logprob: list[float]
    rank: list[int]
    entropy: list[float]
    sampled_entropy: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    top_sampled_logprobs: list[list[float]]
    kv: kv.KVState
    time_ms: float
    # step 0 with echo: the prompt's own tokens, teacher-forced in the prefill pass (per row)
    prompt: list[forced.Forced] | None = None
    # where a waterfall was asked for at this step: one per row (lmtrace.waterfall.stages)
    waterfall: list[dict] | None = None
    # with a Probe (lmtrace.inside): per row, the logit lens and the attention over the cache
    lens: list[dict] | None = None
    attention: list[dict] | None = None


def left_pad(
    prompt_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, max_len) input ids and attention mask, padded on the left."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, p in enumerate(prompt_ids):
        if len(p):
            ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip the left padding, as transformers' generate computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def prefill(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache, all_positions: bool = False
) -> torch.Tensor:
    """Runs the whole prompt once; returns float32 logits of the last position (batch, vocab),
    or with `all_positions` of every position (batch, prompt_len, vocab): the prompt's own
    logprobs come from the same pass (echo)."""
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    out = model(
        input_ids=input_ids,  # (batch, prompt_len)
        attention_mask=attention_mask,
        position_ids=positions(mask),
        logits_to_keep=0 if all_positions else 1,  # 0 keeps them all
        **kv.cache_kwargs(model, cache),
    )
    if all_positions:
        return out.logits.float()
    return out.logits[:, -1, :].float()  # (batch, 1, vocab) -> (batch, vocab)


def prompt_numbers(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, top_n: int) -> list:
    """Teacher-forced numbers of each row's prompt tokens from the prefill logits (batch, len,
    vocab); left padding is skipped, and a row's first token has no prediction."""
    out = []
    for row in range(input_ids.shape[0]):
        start = int((mask[row] == 0).sum())  # left padding
        out.append(forced.measure_targets(logits[row, start:-1], input_ids[row, start + 1 :], top_n))
    return out


def decode_step(
    model, token_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache
) -> torch.Tensor:
    """Feeds only the new tokens (batch,) at `position_ids` (batch, 1); returns (batch, vocab)."""
    out = model(
        input_ids=token_ids[:, None],  # (batch,) -> (batch, 1)
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=1,
        **kv.cache_kwargs(model, cache),
    )
    return out.logits[:, -1, :].float()


def measure(logits: torch.Tensor, processed: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> tuple[list, list]:
    """Per-row numbers for the chosen tokens, moved to the host in two transfers."""
    raw = torch.log_softmax(logits, dim=-1)  # (batch, vocab)
    same = processed is logits  # greedy without penalty: one distribution, computed once
    used = raw if same else torch.log_softmax(processed, dim=-1)
    chosen = token_ids[:, None]  # (batch, 1)
    lp = raw.gather(-1, chosen)
    rank = (raw > lp).sum(-1, keepdim=True) + 1
    raw_entropy = sampling.entropy(raw)[:, None]
    used_entropy = raw_entropy if same else sampling.entropy(used)[:, None]
    floats = [lp, lp if same else used.gather(-1, chosen), raw_entropy, used_entropy]
    ints = [chosen, rank]
    if top_n:
        top_lp, top_ids = torch.topk(raw, top_n, dim=-1)  # (batch, top_n)
        floats += [top_lp, used.gather(-1, top_ids)]
        ints.append(top_ids)
    return torch.cat(floats, -1).tolist(), torch.cat(ints, -1).tolist()


def _check_context(model, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompt_ids)
    if longest == 0:
        raise InvalidParameter("prompt must contain at least one token, got an empty prompt")
    if limit and longest + params.max_new_tokens > limit:
        raise InvalidParameter(
            f"max_new_tokens must fit the context: prompt {longest} + max_new_tokens "
            f"{params.max_new_tokens} > {limit} positions"
        )


def generate_steps(
    model,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    rng: sampling.Rng = None,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    on_token: TokenHook | None = None,
    echo: bool = False,
    waterfall_at: Callable[[int], bool] | None = None,
    compile: bool = False,
    probe: inside.Probe | None = None,
) -> Iterator[BatchStep]:
    """Decodes every prompt of the batch together and yields one BatchStep per step. `rng` is
    one generator for the batch or a list of one per row (see sampling.choose). `echo` adds the
    prompt tokens' numbers to step 0; `waterfall_at(index)` selects the steps that record the
    distribution after each sampling stage; `compile` uses a static cache and a torch.compile'd
    decode step (a one-off compile, the same tokens); `probe` records the logit lens and the
    attention over the cache at every step (lmtrace.inside)."""
    _check_context(model, prompt_ids, params)
    device = model.device
    batch = len(prompt_ids)
    input_ids, mask = left_pad(prompt_ids, pad_token_id, device)
    padded = bool((mask == 0).any())
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros((batch, model.config.vocab_size), dtype=torch.bool, device=device)
        seen.scatter_(1, input_ids, mask.bool())
    next_pos = positions(mask)[:, -1:] + 1  # (batch, 1)
    active = [True] * batch
    static = input_ids.shape[1] + params.max_new_tokens if compile else None
    cache = kv.new_cache(model, static)
    decode = compiled_decode(model) if compile else decode_step
    if compile and padded:  # one mask of the final length keeps the compiled graph's shapes fixed
        mask = torch.cat([mask, mask.new_ones((batch, params.max_new_tokens))], dim=-1)
    expected = expected_bytes(model, batch)
    started = time.perf_counter()
    attached = probe.attached(model) if probe is not None and probe.wanted else contextlib.nullcontext()
    with torch.inference_mode(), attached:
        prompt_mask = mask[:, : input_ids.shape[1]]
        logits = prefill(model, input_ids, prompt_mask if padded else None, cache, all_positions=echo)
        echoed = prompt_numbers(logits, input_ids, prompt_mask, params.top_logprobs) if echo else None
        logits = logits[:, -1, :] if echo else logits  # (batch, len, vocab) -> (batch, vocab)
        for index in range(params.max_new_tokens):
            processed = sampling.process_logits(logits, params, seen)
            tokens = sampling.choose(processed, params, rng)  # (batch,)
            floats, ints = measure(logits, processed, tokens, params.top_logprobs)
            step = _assemble(index, floats, ints, active, params.top_logprobs, kv.state(cache, expected))
            step.prompt = echoed if index == 0 else None
            if probe is not None and probe.wanted:
                step.lens, step.attention = probe.take(index, logits, tokens)
            if waterfall_at is not None and waterfall_at(index):
                step.waterfall = waterfall.stages(logits, params, seen, tokens, params.top_logprobs)
            _finish_rows(step, eos_token_ids, params, on_token)
            step.time_ms = (time.perf_counter() - started) * 1000
            yield step
            active = [a and f is None for a, f in zip(active, step.finish)]
            if not any(active):
                return
            started = time.perf_counter()
            if seen is not None:
                seen.scatter_(1, tokens[:, None], True)
            if len(eos) and not all(active):  # finished rows keep being fed an end token
                done = torch.tensor([not a for a in active], device=device)
                tokens = torch.where(done, eos[0], tokens)
            if padded and not compile:
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
            logits = decode(model, tokens, next_pos, mask if padded else None, cache)
            next_pos = next_pos + 1


def compiled_decode(model) -> Callable[..., torch.Tensor]:
    """decode_step over a torch.compile'd forward, compiled once per model and kept on it."""
    forward = getattr(model, "_lmtrace_compiled_forward", None)
    if forward is None:
        forward = torch.compile(model.forward, dynamic=False)
        model._lmtrace_compiled_forward = forward

    def decode(model, token_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        out = forward(input_ids=token_ids[:, None], attention_mask=attention_mask, position_ids=position_ids,
                      logits_to_keep=1, **kv.cache_kwargs(model, cache))  # fmt: skip
        return out.logits[:, -1, :].float()

    return decode


def expected_bytes(model, batch: int) -> Callable[[int], int] | None:
    """The formula the measured cache is checked against at every step (None where unknown)."""
    try:
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        return kvsize.anatomy(model.config, dtype, batch).bytes_at
    except InvalidParameter:
        return None


def _assemble(index: int, floats: list, ints: list, active: list[bool], n: int, state: kv.KVState) -> BatchStep:
    return BatchStep(
        index=index,
        token_ids=[r[0] for r in ints],
        active=list(active),
        finish=[None] * len(ints),
        logprob=[r[0] for r in floats],
        sampled_logprob=[r[1] for r in floats],
        rank=[r[1] for r in ints],
        entropy=[r[2] for r in floats],
        sampled_entropy=[r[3] for r in floats],
        top_ids=[r[2 : 2 + n] for r in ints],
        top_logprobs=[r[4 : 4 + n] for r in floats],
        top_sampled_logprobs=[r[4 + n : 4 + 2 * n] for r in floats],
        kv=state,
        time_ms=0.0,
    )


def _finish_rows(
    step: BatchStep, eos_token_ids: Sequence[int], params: SamplingParams, on_token: TokenHook | None
) -> None:
    last = step.index == params.max_new_tokens - 1
    for row, token in enumerate(step.token_ids):
        if not step.active[row]:
            continue
        hit = on_token(row, token) if on_token is not None else False
        if params.stop_on_eos and token in eos_token_ids:
            step.finish[row] = "eos"
        elif hit:
            step.finish[row] = "stop"
        elif last:
            step.finish[row] = "length"
