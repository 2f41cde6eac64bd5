"""`compile=True` (`--compile`): the static, compiled decode step, as gpt-fast and transformers'
static-cache generate run it. A preallocated StaticCache of a fixed length (a multiple of
BUCKET: one graph serves every prompt up to it), and one function compiled with torch.compile
(`mode="reduce-overhead"` on CUDA: CUDA graphs; the default mode elsewhere) that runs the whole
step with no host synchronisation: the forward, the float32 logits, the processors, the greedy
choice and the chosen token's numbers (lmtrace.logits.measure's one rule). A sampled row draws
with its own torch.Generator outside the graph (the default path's draw, bit for bit), then a
second compiled function measures it. The numbers reach the host a step behind (engine.py).

What needs the host at every step (a grammar's mask, the user's Python processors, observers)
keeps the compiled forward on the static cache and runs the step eagerly (FORWARD); a draft's
one-token step is its compiled forward (DRAFT). The trace's `model.config.compile` says which ran."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger
from lmtrace.logits import measure, processors, sampling
from lmtrace.model.grouped_attention import grouped
from lmtrace.model.invariant import mode as invariant_mode
from lmtrace.params import SamplingParams

# a static cache holds a multiple of this many positions: one graph per bucket, not per length
BUCKET = 256

STEP = "static cache, compiled step (forward, processors, choice, numbers)"
FORWARD = "static cache, compiled forward (the step eager: grammar, logits processors or observers)"
DRAFT = "the draft's steps compiled on a static cache (graphs of one and two tokens; the target's verify forward eager)"


def capacity(positions: int) -> int:
    """The static cache's length for `positions`: whole buckets."""
    return -(-positions // BUCKET) * BUCKET


def mode(device: torch.device | str) -> str:
    """torch.compile's mode: CUDA graphs on a GPU (launches dominate a batch-1 step there)."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else "default"


def described(kind: str, device: torch.device | str) -> str:
    """The trace's `model.config.compile`: what ran compiled, and the mode."""
    return f"{kind}; torch.compile mode {mode(device)}"


def check(model: Any, option: str = "compile") -> None:
    """Refuses, in one line, a model whose kernels torch.compile cannot trace: the oneDNN
    linear layers (`matmul="onednn"`: Inductor cannot lower mkldnn's fused linear); and, but for
    a draft, a load packed for torch's bfloat16 int4 kernel, whose compiled numbers would leave the
    opt-in bound (PACKED). A load packed for lmtrace's own kernel (float32 inputs) compiles, the
    kernel one opaque operation in the graph."""
    if invariant_mode.active(model):
        raise InvalidParameter(
            f"{option}: compile cannot be combined with batch_invariant (Inductor cannot lower its oneDNN "
            "products); load without batch_invariant to compile"
        )
    matmul = getattr(model, "lmtrace_matmul", None)
    if matmul is not None:
        raise InvalidParameter(
            f"{option}: compile cannot be combined with matmul {matmul.split()[0]}; load without matmul to compile"
        )
    packed = getattr(model, "lmtrace_packed", None)
    if option != "draft" and packed is not None and packed.compute_dtype != "float32":
        raise InvalidParameter(PACKED)


# A layer packed for torch's int4 kernel rounds its input to bfloat16: the compiled graph's float32
# rounding, 1e-7 apart from eager's, flips some of those roundings, and the packed path's logprobs
# move by up to 0.1 (bundled model) where an opt-in path may move them 5e-5. A packed draft's
# numbers never reach the trace (the target verifies each proposal): it compiles.
PACKED = (
    "compile: not with weights packed on torch's int4 kernel (no C compiler for lmtrace's: its bfloat16 inputs "
    "turn the compiled graph's rounding into logprobs up to 0.1 apart from the packed path's); a packed draft "
    "compiles: --draft packed --compile"
)


def whole_step(constrained: bool, user: Any, observers: Any) -> bool:
    """Whether the whole step can be compiled: nothing in it needs the host at every step."""
    return not constrained and not user and not observers


@dataclass
class Out:
    """One compiled step's tensors, still on the device: the tokens (batch,) and measure.chosen's
    floats (batch, 4 + 2n) and ints (batch, 2 + n)."""

    tokens: torch.Tensor
    floats: torch.Tensor
    ints: torch.Tensor


def forward_of(model: Any) -> Callable[..., torch.Tensor]:
    """The one-token forward over the cache, (batch, 1, hidden) input embeddings (`embedded`) ->
    (batch, vocab) float32 logits; the cache's keyword is read here, outside any compiled region
    (ledger.cache_kwargs is cached)."""
    name = next(iter(ledger.cache_kwargs(model, None)))

    def forward(embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
        out = model(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=1,
            use_cache=True,
            **{name: cache},
        )  # one new token a row
        return out.logits[:, -1, :].float()  # (batch, 1, vocab) -> (batch, vocab)

    return forward


def embedded(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """(batch,) tokens -> (batch, 1, hidden), (batch, n) -> (batch, n, hidden): the model's own
    input embedding, run before the compiled graph (as the model runs it on input_ids: Gemma's
    scaling included), so that a lookup torch.compile cannot trace (a packed load's rows,
    dequantized on the host from the GGUF file) leaves the graph whole."""
    return model.get_input_embeddings()(tokens[:, None] if tokens.dim() == 1 else tokens)


class StaticStep:
    """The compiled step of one model for one way of choosing (params, top_n): `greedy(...)` ->
    Out, or `logits(...)` then a draw then `measured(...)` for a sampled batch."""

    def __init__(self, model: Any, params: SamplingParams, top_n: int):
        self.model, self.params, self.top_n = model, params, top_n
        how, forward = mode(model.device), forward_of(model)

        def greedy(embeds, positions, mask, cache, seen):
            logits = forward(embeds, positions, mask, cache)
            processed = sampling.process_logits(logits, params, seen)
            chosen = processed.max(dim=-1).indices  # argmax's first of the largest, as sampling.choose
            floats, ints = measure.chosen_tensors(logits, processed, chosen, top_n)
            return chosen, floats, ints

        def processed(embeds, positions, mask, cache, seen):
            logits = forward(embeds, positions, mask, cache)
            return logits, sampling.process_logits(logits, params, seen)

        def numbers(logits, processed, chosen):
            return measure.chosen_tensors(logits, processed, chosen, top_n)

        self._functions, self._how = (greedy, processed, numbers), how
        self._compiled: tuple[Callable[..., Any], ...] | None = None  # made at the first call, which shows the cache
        self.graphs = how == "reduce-overhead"

    def _made(self, cache: Any) -> tuple[Callable[..., Any], ...]:
        if self._compiled is None:
            dynamic = shapes(cache)
            self._compiled = tuple(torch.compile(f, mode=self._how, dynamic=dynamic) for f in self._functions)
        return self._compiled

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Any,
        seen: torch.Tensor | None,
        rng: sampling.Rng,
    ) -> Out:
        """One step from the fed tokens (batch,) at `positions` (batch, 1): the next tokens and
        their numbers, all on the device."""
        if self.graphs:  # a new iteration: the graphs may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        embeds = embedded(self.model, tokens)
        greedy, processed_of, numbers = self._made(cache)
        if self.params.greedy:
            with grouped(self.model):
                chosen, floats, ints = greedy(embeds, positions, mask, cache, seen)
            return Out(chosen.clone(), floats.clone(), ints.clone())
        with grouped(self.model):
            logits, processed = processed_of(embeds, positions, mask, cache, seen)
        chosen = sampling.choose(processed, self.params, rng)  # the row's generator: outside the graph
        floats, ints = numbers(logits, processed, chosen)
        return Out(chosen.clone(), floats.clone(), ints.clone())


@contextlib.contextmanager
def held_cache(model: Any, batch: int, length: int) -> Iterator[Any]:
    """A StaticCache of `length` positions for `batch` rows, kept on the model between generations
    and reset before each (as transformers' generate keeps its own): its tensors keep their
    addresses, so CUDA graphs recorded over them replay without recording again. One generation
    holds it at a time; another at once gets a cache of its own."""
    pool = model.__dict__.setdefault("_lmtrace_static_caches", {})
    free = pool.setdefault((id(model), batch, length, next(model.parameters()).dtype), [])
    cache = free.pop() if free else ledger.new_cache(model, length)
    cache.reset()
    try:
        yield cache
    finally:
        free.append(cache)


def step_for(model: Any, params: SamplingParams, top_n: int) -> StaticStep:
    """The model's compiled step for these params, made once and kept on the model (keyed by the
    model's id: a shallow copy, a `layers:N` draft, compiles its own)."""
    key = (id(model), top_n, params.greedy, *(_hashable(getattr(params, name)) for name in processors.ORDER))
    steps = model.__dict__.setdefault("_lmtrace_static_steps", {})
    if key not in steps:
        steps[key] = StaticStep(model, params, top_n)
    return steps[key]


def compiled_forward(model: Any) -> Callable[..., torch.Tensor]:
    """The forward alone compiled (FORWARD, DRAFT), once per model: a function with
    engine.decode_step's arguments and result (batch, vocab) float32 (tokens (batch, n) with
    positions (batch, n): the last position's logits, one graph per n)."""
    graphs = mode(model.device) == "reduce-overhead"

    def decode(
        model: Any, token_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any, cache: Any
    ) -> torch.Tensor:
        owner, forward = model.__dict__.get("_lmtrace_compiled_forward", (None, None))
        if owner != id(model):  # made at the first call, which shows the cache
            forward = torch.compile(forward_of(model), mode=mode(model.device), dynamic=shapes(cache))
            model.__dict__["_lmtrace_compiled_forward"] = (id(model), forward)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with grouped(model):
            return forward(embedded(model, token_ids), position_ids, attention_mask, cache).clone()

    return decode


def shapes(cache: Any) -> bool | None:
    """torch.compile's `dynamic` for a step over `cache`: False (every shape static, one graph for
    the bucket), but None (torch's automatic dynamic) where a layer slides: transformers'
    StaticSlidingWindowLayer keeps its length in a Python int, so static shapes recompiled at every
    step until torch.compile's limit, then ran eager (Gemma 3); left dynamic after its second value,
    it costs a graph or two more over the whole run."""
    sliding = any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))
    return None if sliding else False


def _hashable(setting: Any) -> Any:
    """A processor's setting as part of a key (a logit_bias dict as its sorted items)."""
    return tuple(sorted(setting.items())) if isinstance(setting, dict) else setting
