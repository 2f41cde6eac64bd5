"""The decoding processors, declared once as an ordered list: each a name (the SamplingParams
field it reads, the waterfall's stage), when it applies and what it does to float32 logits
(batch, vocab). Processing is a fold over the list, the waterfall a scan of the same list, vLLM's
order a second ordering of it (lmtrace.vllm.params).

    ORDER       logit_bias -> repetition_penalty -> temperature -> top_k -> top_p -> min_p (transformers')
    VLLM_ORDER  logit_bias -> repetition_penalty -> temperature -> min_p -> top_k -> top_p

`logit_bias` ({token id: bias}) adds each bias to its token's logit, first, as OpenAI and vLLM
apply it (vLLM's LogitBiasLogitsProcessor before its penalties and temperature; transformers'
SequenceBiasLogitsProcessor of one-token sequences before its repetition penalty); it applies to
greedy decoding too, and is listed (in the plan, the waterfall) only where a request has one.

A user's own processors (`lmtrace.generate(..., logits_processors=[fn])`, `fn(token_ids, logits)
-> logits` as vLLM's and mlx-lm's) run first, before the built-in ones, each over one row: its
tokens generated so far and its (vocab,) logits; the waterfall lists each under its name.

Each filter writes -inf where it removes a token and keeps at least one token, exactly as
transformers' RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper and MinPLogitsWarper do (the tests check against them). Greedy decoding applies
only the logit bias and the penalty (and the user's processors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.errors import GenerationError, InvalidParameter
from lmtrace.params import SamplingParams

NEG_INF = float("-inf")


def check_logit_bias(bias: dict[int, float], vocab: int) -> None:
    """Every biased token id is in the vocabulary; else InvalidParameter naming it."""
    outside = next((t for t in bias if t >= vocab), None)
    if outside is not None:
        raise InvalidParameter(
            f"logit_bias: token id {outside} is not in the vocabulary ({vocab} tokens: ids 0 to {vocab - 1})"
        )


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """Each bias added to its token's logit in every row of (batch, vocab) logits, as
    transformers' SequenceBiasLogitsProcessor adds a one-token sequence's bias (float32)."""
    if len(bias) == 0:
        return logits
    check_logit_bias(bias, logits.shape[-1])
    ids = torch.tensor(list(bias), device=logits.device)  # (n,)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)  # (n,)
    out = logits.clone()
    out[..., ids] += values
    return out


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """`seen` is a (batch, vocab) bool mask of the tokens in each sequence so far."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    # a tiny penalty can push a logit past float32's range: +inf would make the softmax NaN
    penalized = penalized.clamp(max=torch.finfo(penalized.dtype).max)
    return torch.where(seen, penalized, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature in (0.0, 1.0):
        return logits
    out = logits / temperature
    bad = torch.isposinf(out) | torch.isnan(out)
    if torch.compiler.is_compiling():  # no host sync in a compiled step: both ways, chosen per row
        return torch.where(bad.any(-1, keepdim=True), _shifted(logits, temperature), out)
    if bad.any():
        out = _shifted(logits, temperature)
    return out


def _shifted(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A temperature so small that logits overflow float32 (or that is 0 in float32): the same
    distribution from logits shifted to a maximum of 0 (a softmax ignores a shift), divided in
    float64; what stays below the maximum goes to -inf, as in the limit."""
    shifted = logits.double() - logits.amax(dim=-1, keepdim=True).double()
    return (shifted / temperature).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (batch, 1)
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    # min_p <= 1, so the most likely token always survives: no extra keep-one step is needed
    remove = probs < threshold
    return logits.masked_fill(remove, NEG_INF)


def seen_mask(
    params: SamplingParams, rows: Sequence[Sequence[int]], vocab: int, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """The repetition penalty's view: (len(rows), vocab) bool, True at each token a row has seen
    (its prompt, and whatever it generated so far); None without a penalty (nothing to keep)."""
    if params.repetition_penalty == 1.0:
        return None
    seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
    for r, ids in enumerate(rows):
        if len(ids):
            seen[r, list(ids)] = True
    return seen


@dataclass(frozen=True)
class Processor:
    """One built-in stage: `name` is its SamplingParams field; `applies(params, seen)` says
    whether it changes anything for these params; `apply(logits, params, seen)` does it. A stage
    that is not `always` listed is in the plan (and the waterfall) only where it applies."""

    name: str
    applies: Callable[[SamplingParams, torch.Tensor | None], bool]
    apply: Callable[[torch.Tensor, SamplingParams, torch.Tensor | None], torch.Tensor]
    always: bool = True

    def setting(self, params: SamplingParams) -> Any:
        """The stage's setting as a record holds it (a logit bias's keys as JSON writes them)."""
        value = getattr(params, self.name)
        return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value


PROCESSORS = {
    p.name: p
    for p in (
        Processor(
            "logit_bias",
            lambda p, _: len(p.logit_bias) > 0,  # not bool(): torch.compile guards a dict's length, not its truth
            lambda x, p, _: apply_logit_bias(x, p.logit_bias),
            always=False,
        ),
        Processor(
            "repetition_penalty",
            lambda p, seen: p.repetition_penalty != 1.0 and seen is not None,
            lambda x, p, seen: apply_repetition_penalty(x, seen, p.repetition_penalty),
        ),
        Processor(
            "temperature",
            lambda p, _: not p.greedy and p.temperature != 1.0,
            lambda x, p, _: apply_temperature(x, p.temperature),
        ),
        Processor("top_k", lambda p, _: not p.greedy and p.top_k > 0, lambda x, p, _: apply_top_k(x, p.top_k)),
        Processor("top_p", lambda p, _: not p.greedy and p.top_p < 1.0, lambda x, p, _: apply_top_p(x, p.top_p)),
        Processor("min_p", lambda p, _: not p.greedy and p.min_p > 0, lambda x, p, _: apply_min_p(x, p.min_p)),
    )
}
ORDER = ("logit_bias", "repetition_penalty", "temperature", "top_k", "top_p", "min_p")  # transformers'
VLLM_ORDER = ("logit_bias", "repetition_penalty", "temperature", "min_p", "top_k", "top_p")  # vLLM's sampler


# a user's processor: (the row's generated token ids so far, its logits (vocab,)) -> logits (vocab,)
UserFn = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class UserProcessor:
    """A user's processor and the name it is recorded under (its `name` attribute, else the
    function's name)."""

    fn: UserFn
    name: str

    def __call__(self, logits: torch.Tensor, history: Sequence[Sequence[int]]) -> torch.Tensor:
        """Row by row over (batch, vocab) logits, each row with its own tokens so far."""
        rows = []
        for r in range(logits.shape[0]):
            out = self.fn(list(history[r]), logits[r].clone())
            if not isinstance(out, torch.Tensor) or out.shape != logits[r].shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise GenerationError(
                    f"logits_processors: {self.name} must return logits of shape {tuple(logits[r].shape)}, got {got}"
                )
            rows.append(out.to(logits.dtype))
        return torch.stack(rows)  # (batch, vocab)


def user_processors(fns: Sequence[Any] | None) -> tuple[UserProcessor, ...]:
    """The user's callables as named processors (one already named, such as a server's registered
    processor, as it is); anything not callable is bad input."""
    out = []
    for fn in fns or ():
        if isinstance(fn, UserProcessor):
            out.append(fn)
            continue
        if not callable(fn):
            raise InvalidParameter(
                f"logits_processors: each must be a callable (token_ids, logits) -> logits, got {type(fn).__name__}"
            )
        out.append(UserProcessor(fn, str(getattr(fn, "name", None) or getattr(fn, "__name__", type(fn).__name__))))
    return tuple(out)


@dataclass(frozen=True)
class Stage:
    """One stage of a row's processing: its name, setting, whether it applied, and what it does."""

    name: str
    setting: Any
    applied: bool
    run: Callable[[torch.Tensor], torch.Tensor]


def plan(
    params: SamplingParams,
    seen: torch.Tensor | None,
    order: Sequence[str] = ORDER,
    user: Sequence[UserProcessor] = (),
    history: Sequence[Sequence[int]] | None = None,
) -> list[Stage]:
    """The stages for these params, in order: the user's processors, then the built-in ones."""
    stages = [Stage(u.name, "user", True, lambda x, u=u: u(x, history or [[]] * x.shape[0])) for u in user]
    for name in order:
        p = PROCESSORS[name]
        if not p.always and not p.applies(params, seen):
            continue
        stages.append(Stage(name, p.setting(params), p.applies(params, seen), lambda x, p=p: p.apply(x, params, seen)))
    return stages


def process(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None,
    order: Sequence[str] = ORDER,
    user: Sequence[UserProcessor] = (),
    history: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The distribution a token is chosen from, as logits (batch, vocab): the fold of the plan."""
    out = logits
    for stage in plan(params, seen, order, user, history):
        if stage.applied:
            out = stage.run(out)
    return out


def scan(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None,
    order: Sequence[str] = ORDER,
    user: Sequence[UserProcessor] = (),
    history: Sequence[Sequence[int]] | None = None,
) -> list[tuple[str, Any, bool, torch.Tensor]]:
    """[(stage, setting, applied, logits after it)] for every stage of the plan (the waterfall)."""
    out, x = [], logits
    for stage in plan(params, seen, order, user, history):
        if stage.applied:
            x = stage.run(x)
        out.append((stage.name, stage.setting, stage.applied, x))
    return out
