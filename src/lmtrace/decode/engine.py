"""The explicit decoding loop: one prefill forward over the prompt, then one forward per step
that feeds only the new token and the KV cache. Each step is decode/step.py's `take`; what is
recorded beside the numbers comes from the observers (decode/observers.py). No printing, no
files."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lmtrace.decode import static
from lmtrace.decode.loop import Finish, Watch, advance
from lmtrace.decode.observers import Observer, attached
from lmtrace.decode.step import BatchStep, Choosing, TokenHook
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger, size
from lmtrace.logits import grammar, processors, sampling
from lmtrace.params import SamplingParams


@dataclass
class Setup:
    """What the loop needs besides the prompts, the params and the generator: the model's end
    and pad tokens, a hook that sees each chosen token (stop strings), a compiled decode step
    (a static cache and torch.compile: a one-off compile, the same tokens), the observers, each
    row's grammar matcher (lmtrace.decode.constrained.matchers; None: unconstrained), the user's
    own logits processors (lmtrace.logits.processors.UserProcessor)."""

    eos_token_ids: Sequence[int] = ()
    pad_token_id: int = 0
    on_token: TokenHook | None = None
    compile: bool = False
    observers: Sequence[Observer] = field(default_factory=list)
    grammars: Sequence[grammar.Matcher | None] | None = None
    user: Sequence[processors.UserProcessor] = ()


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
        **ledger.cache_kwargs(model, cache),
    )
    if all_positions:
        return out.logits.float()
    return out.logits[:, -1, :].float()  # (batch, 1, vocab) -> (batch, vocab)


def decode_step(
    model, token_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache
) -> torch.Tensor:
    """Feeds only the new tokens (batch,) at `position_ids` (batch, 1); returns (batch, vocab)."""
    out = model(
        input_ids=token_ids[:, None],  # (batch,) -> (batch, 1)
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=1,
        **ledger.cache_kwargs(model, cache),
    )
    return out.logits[:, -1, :].float()


def check_context(model, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> None:
    """An empty prompt, one that leaves no room for max_new_tokens, or a logit bias of a token
    outside the vocabulary is bad input."""
    vocab = getattr(model.config, "vocab_size", None)
    if params.logit_bias and vocab:
        processors.check_logit_bias(params.logit_bias, int(vocab))
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
    setup: Setup | None = None,
) -> Iterator[BatchStep]:
    """Decodes every prompt of the batch together and yields one BatchStep per step. `rng` is
    one generator for the batch or a list of one per row (see sampling.choose)."""
    setup = setup or Setup()
    check_context(model, prompt_ids, params)
    batch = len(prompt_ids)
    input_ids, mask = left_pad(prompt_ids, setup.pad_token_id, model.device)
    padded = bool((mask == 0).any())
    seen = processors.seen_mask(params, prompt_ids, model.config.vocab_size, model.device)  # (batch, vocab)
    history = [[] for _ in prompt_ids] if setup.user else None
    how = Choosing([params], rng, seen, grammars=setup.grammars, user=setup.user, history=history)
    next_pos = positions(mask)[:, -1:] + 1  # (batch, 1)
    length = static.capacity(input_ids.shape[1] + params.max_new_tokens)  # with compile: whole buckets
    cache = ledger.new_cache(model, length if setup.compile else None)
    decode = static.compiled_forward(model) if setup.compile else decode_step
    if setup.compile and padded:  # one mask of the cache's length keeps the compiled graph's shapes fixed
        mask = torch.cat([mask, mask.new_ones((batch, length - input_ids.shape[1]))], dim=-1)
    expected = expected_bytes(model, batch)
    eos = torch.tensor(sorted(set(setup.eos_token_ids)), dtype=torch.long, device=model.device)
    active = [True] * batch
    watch = Watch(setup.observers, finish=Finish(setup.eos_token_ids, params, setup.on_token))
    started = time.perf_counter()
    with torch.inference_mode(), attached(setup.observers, model):
        logits = prefill_observed(model, input_ids, mask[:, : input_ids.shape[1]], padded, cache, setup.observers)
        for index in range(params.max_new_tokens):
            tokens, step = advance(index, logits, how, active, ledger.state(cache, expected), watch)
            step.time_ms = (time.perf_counter() - started) * 1000
            yield step
            active = [a and f is None for a, f in zip(active, step.finish)]
            if not any(active):
                return
            started = time.perf_counter()
            how.saw(tokens)
            if len(eos) and not all(active):  # finished rows keep being fed an end token
                tokens = torch.where(torch.tensor([not a for a in active], device=model.device), eos[0], tokens)
            if padded and not setup.compile:
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
            logits = decode(model, tokens, next_pos, mask if padded else None, cache)
            next_pos = next_pos + 1


def prefill_observed(model, input_ids, prompt_mask, padded: bool, cache, observers: Sequence[Observer]) -> torch.Tensor:
    """The prefill, handed to the observers; returns the last position's logits (batch, vocab)."""
    all_positions = any(o.all_positions for o in observers)
    logits = prefill(model, input_ids, prompt_mask if padded else None, cache, all_positions=all_positions)
    for observer in observers:
        observer.prefill(logits, input_ids, prompt_mask)
    return logits[:, -1, :] if all_positions else logits  # (batch, len, vocab) -> (batch, vocab)


def expected_bytes(model, batch: int) -> Callable[[int], int] | None:
    """The formula the measured cache is checked against at every step (None where unknown)."""
    try:
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        return size.anatomy(model.config, dtype, batch).bytes_at
    except InvalidParameter:
        return None
