"""The explicit decoding loop: one prefill forward over the prompt, then one forward per step
that feeds only the new token and the KV cache: the static batch, a source of decode/loop.py's
one loop (`drive`), which runs each step (decode/step.py's `take`) and the observers
(decode/observers.py). No printing, no files."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lmtrace.decode import static
from lmtrace.decode.choosing import Rows, choosing
from lmtrace.decode.loop import Fed, Finish, Watch, drive
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
    rows = Rows([params], rng, prompt_ids, [[] for _ in prompt_ids], grammars=setup.grammars, user=setup.user)
    how = choosing(rows, model)  # the penalty's seen tokens (batch, vocab) from the prompts
    length = static.capacity(input_ids.shape[1] + params.max_new_tokens)  # with compile: whole buckets
    cache = ledger.new_cache(model, length if setup.compile else None)
    if setup.compile and padded:  # one mask of the cache's length keeps the compiled graph's shapes fixed
        mask = torch.cat([mask, mask.new_ones((batch, length - input_ids.shape[1]))], dim=-1)
    watch = Watch(setup.observers, finish=Finish(setup.eos_token_ids, params, setup.on_token))
    started = time.perf_counter()
    with torch.inference_mode(), attached(setup.observers, model):
        logits = prefill_observed(model, input_ids, mask[:, : input_ids.shape[1]], padded, cache, setup.observers)
        source = Batch(model, how, watch, cache, setup)
        source.feeding(logits, mask if padded else None, positions(mask)[:, -1:] + 1)
        for _, step in drive(source, started):
            yield step


class Batch:
    """The static batch as the loop's source (decode/loop.py): every row steps until all have
    finished or the params' max_new_tokens; a finished row keeps being fed an end token; each step
    feeds only the new tokens (the compiled forward with `setup.compile`)."""

    def __init__(self, model, how: Choosing, watch: Watch, cache, setup: Setup):
        self.model, self.how, self.watch, self.cache, self.setup = model, how, watch, cache, setup
        self.limit = how.params[0].max_new_tokens
        self.forward = static.compiled_forward(model) if setup.compile else decode_step
        self.eos = torch.tensor(sorted(set(setup.eos_token_ids)), dtype=torch.long, device=model.device)
        self.index, self.logits, self.mask, self.next_pos = 0, None, None, None
        self.active: list[bool] = []

    def feeding(self, logits: torch.Tensor, mask: torch.Tensor | None, next_pos: torch.Tensor) -> None:
        """The first step's logits (batch, vocab), the attention mask (None: no padding) and the
        positions (batch, 1) the next forward feeds."""
        self.logits, self.mask, self.next_pos, self.active = logits, mask, next_pos, [True] * len(logits)
        self.expected = expected_bytes(self.model, len(logits))

    def next(self) -> Fed | None:
        if self.index >= self.limit or not any(self.active):
            return None
        kv = ledger.state(self.cache, self.expected)
        return Fed(self.index, self.logits, self.how, self.active, kv, self.watch)

    def chose(self, tokens: torch.Tensor, step: BatchStep) -> None:
        pass

    def took(self, tokens: torch.Tensor, step: BatchStep | None) -> None:
        """The rows that finished leave `active`; the others' next forward."""
        self.active = [a and f is None for a, f in zip(self.active, step.finish)]
        self.index += 1
        if self.index >= self.limit or not any(self.active):
            return
        if len(self.eos) and not all(self.active):  # finished rows keep being fed an end token
            ended = torch.tensor([not a for a in self.active], device=self.model.device)
            tokens = torch.where(ended, self.eos[0], tokens)
        if self.mask is not None and not self.setup.compile:
            self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.active), 1))], dim=-1)
        self.logits = self.forward(self.model, tokens, self.next_pos, self.mask, self.cache)
        self.next_pos = self.next_pos + 1


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
