"""A row while it decodes (`RowState`, the one row state of every loop: generate's static batch,
continuous batching, speculative blocks, branches), and the records made from the engine's
numbers: the text pieces (held back where a character spans tokens), stop strings, each Step,
and the Trace at the end."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.decode import constrained, observers
from lmtrace.decode.step import BatchStep
from lmtrace.detokenize import IncrementalDetokenizer, TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.inside import probe as inside
from lmtrace.kv import size
from lmtrace.logits import forced
from lmtrace.logits import waterfall as waterfall_mod
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Step, Trace
from lmtrace.records.alternatives import alternatives
from lmtrace.records.steps import StepNumbers, new_step
from lmtrace.records.timing import timing
from lmtrace.records.traces import new_trace
from lmtrace.stops import StopStrings, finish_reason


@dataclass
class RowSpec:
    """One row to decode: its prompt (ids and text) and its own params. `on_step(step)` is
    called with each of its steps on the decoding thread; an exception it raises takes the row
    out of the batch (a server uses this when the client has gone)."""

    ids: list[int]
    params: SamplingParams
    text: str = ""
    chat: bool = False
    on_step: Callable[[Step], None] | None = None
    tag: Any = None  # the caller's own reference (a request, a line)
    # what this row records beside its numbers (decode/observers.py; observers that need no
    # hooks on the forward: they see the batch's logits, and only this row's entries are kept)
    observers: Sequence[observers.Observer] = ()
    # the logit lens and the attention over the cache (decode/row_inside.py): True, or for
    # attention "heads" (each head's own too)
    lens: bool = False
    attention: bool | str = False
    # speculative decoding (decode/drafted.py): a lmtrace.model.draft.Draft proposing
    # `draft_tokens` a block; the row decodes one block per batch step beside the batch
    draft: Any = None
    draft_tokens: int | str = 4
    # the prompt's own logprobs (`trace.prompt_logprobs`, as generate's `echo`), from its prefill
    echo: bool = False
    # the user's processors (lmtrace.logits.processors.UserProcessor), run first on this row alone
    logits_processors: Sequence[Any] = ()


class StopRow(Exception):
    """Raised by a row's `on_step` to end the row after this step (an early stop, such as
    DeepConf's): the row leaves the batch with its trace, whose finish_reason is `reason`."""

    def __init__(self, reason: str = "stop"):
        super().__init__(reason)
        self.reason = reason


def make_params(params: SamplingParams | None = None, entry: str = "generate", **kwargs: Any) -> SamplingParams:
    """`params` with `kwargs` laid over them (or SamplingParams(**kwargs)). A keyword that is no
    sampling setting is an option the entry point (`entry`) does not take: refused in one line
    that names both."""
    for name in kwargs:
        if name not in SamplingParams.__dataclass_fields__:
            raise InvalidParameter(f"{name}: {entry} does not take {name}")
    if params is not None and kwargs:
        merged = {**params.to_dict(), **kwargs}
        return SamplingParams.from_dict(merged)
    return params if params is not None else SamplingParams(**kwargs)


class RowState:
    """One row while it decodes, whichever loop drives it (the static batch, a continuous batch,
    a speculative block, a branch): its params, its records (detokenizer, stop strings, steps,
    the stop reason) and, where it decodes in a continuous batch (`joining`), its own random
    stream, grammar, penalty mask and position. A static batch's rows choose together from the
    batch's params (decode/choosing.py `Rows`); their state holds only the records."""

    def __init__(self, lm: LM, params: SamplingParams, spec: RowSpec | None = None):
        self.spec = spec
        self.params = params
        self.detok = IncrementalDetokenizer(lm.tokenizer)
        self.held = StopStrings(params.stop)  # fed the pieces the detokenizer emits, up to the end token
        self.steps: list[Step] = []
        self.piece = ""
        self.stop_reason: str | int | None = None
        self.text_before_eos: str | None = None
        self.prompt_logprobs: list | None = None  # with echo: the prompt's TokenScores
        self.grammar = None  # the row's grammar matcher (None: unconstrained, or the batch's)
        self.generator: torch.Generator | None = None
        self.seen: torch.Tensor | None = None  # (1, vocab) bool, with a repetition penalty
        self.index = 0  # steps produced so far
        self.position = len(spec.ids) if spec is not None else 0  # of the next token fed
        self.step_ms = 0.0
        self.cached = 0  # prompt tokens whose KV came from a prefix cache
        self.trace: Trace | None = None
        self.error: BaseException | None = None
        self.inside: Any = None  # with lens / attention: what its last forward captured (row_inside)

    @classmethod
    def joining(cls, lm: LM, spec: RowSpec) -> RowState:
        """A row of a continuous batch: seeded params, its own grammar matcher and random stream."""
        state = cls(lm, seeded(spec.params), spec)
        found = constrained.matchers(lm, [state.params])
        state.grammar = found[0] if found else None
        state.generator = generator(lm, state.params)
        return state

    def closing(self, finish: str | None, token_id: int) -> str:
        """This step's text: the piece its token added, and at the row's last step whatever the
        detokenizer held back (an end token also becomes the stop reason)."""
        if finish == "eos":
            self.stop_reason = token_id
        return self.piece + (self.detok.flush() if finish else "")

    def add(self, token_id: int, is_eos: bool) -> bool:
        """Feeds a token; True when a stop string is now complete."""
        if is_eos:  # the answer's text ends before the end token, held-back bytes included
            self.text_before_eos = self.detok.tokenizer.decode(self.detok.ids)
        self.piece = self.detok.add(token_id)
        if is_eos or not self.held.feed(self.piece):
            return False
        self.stop_reason = self.held.stop
        return True


def step_record(lm: LM, bs: BatchStep, row: int, piece: str, tb: TokenBytes) -> Step:
    top = alternatives(bs.top_ids[row], bs.top_logprobs[row], bs.top_sampled_logprobs[row], tb)
    token = bs.token_ids[row]
    kv = bs.kv.to_dict()
    if bs.crop is not None:  # speculative decoding: the caches cut back after a rejection
        kv["crop"] = bs.crop
    draft = bs.draft[row] if bs.draft else None
    stages = (bs.entries.get("waterfall") or [None] * (row + 1))[row]
    inside_row = (bs.entries.get("inside") or [None] * (row + 1))[row] or {}
    if draft is not None:
        proposed = draft["proposed_token_id"]
        draft = {**draft, "text": tb.text(proposed), "bytes": list(tb(proposed))}
    numbers = StepNumbers(
        bs.logprob[row], bs.sampled_logprob[row], bs.rank[row], bs.entropy[row], bs.sampled_entropy[row]
    )
    return new_step(
        bs.index,
        token,
        piece,
        numbers,
        top,
        tb,
        kv=kv,
        time_ms=bs.time_ms,
        waterfall=waterfall_mod.with_texts(stages, tb.text) if stages is not None else None,
        lens=_named(inside_row.get("lens"), tb),
        attention=_named(inside_row.get("attention"), tb),
        grammar=bs.grammar[row] if bs.grammar else None,
        draft=draft,
        entries={
            name: rows[row]
            for name, rows in bs.entries.items()
            if name not in observers.BUILT_IN and rows[row] is not None
        },  # fmt: skip
    )


def _named(record: dict | None, tb: TokenBytes) -> dict | None:
    """A row's lens or attention record with each token's text (None where it has none)."""
    return None if record is None else inside.with_texts(record, tb.text)


def generator(lm: LM, params: SamplingParams) -> torch.Generator | None:
    """The row's random stream, seeded by its params (None for greedy decoding)."""
    if params.greedy:
        return None
    return torch.Generator(device=lm.model.device).manual_seed(params.seed)


def records(
    lm: LM, prompts: Sequence[list[int]], steps: Iterator[BatchStep], rows: list[RowState]
) -> Iterator[tuple[int, Step]]:
    """The engine's BatchSteps as (row, Step) records; `rows` were fed each token by the hook."""
    tb = TokenBytes(lm.tokenizer)
    for bs in steps:
        if bs.entries.get("prompt") is not None:
            for ids, state, numbers in zip(prompts, rows, bs.entries["prompt"]):
                state.prompt_logprobs = forced.token_scores(lm.tokenizer, ids, 0, numbers, tb)
        for r, state in enumerate(rows):
            if not bs.active[r]:
                continue
            step = step_record(lm, bs, r, state.closing(bs.finish[r], bs.token_ids[r]), tb)
            state.steps.append(step)
            yield r, step


def _templated(lm: LM, ids: list[int], chat: bool) -> dict:
    """With the chat template: the whole prompt the model saw (its system prompt included)."""
    return {"templated": lm.tokenizer.decode(ids)} if chat else {}


@dataclass(frozen=True)
class Extras:
    """What a trace carries beside its row's steps, from the plan that decoded it: `compile` what
    ran compiled (lmtrace.decode.static; None: nothing), `probe` the lens/attention probe (its
    params and the prompt's tokens), `watchers` the observers whose summaries go on the trace."""

    compile: str | None = None
    probe: inside.Probe | None = None
    watchers: Sequence[observers.Observer] = ()


def to_trace(
    lm: LM,
    prompt: str,
    ids: list[int],
    params: SamplingParams,
    row: RowState,
    chat: bool,
    extras: Extras | None = None,
) -> Trace:
    """The row's Trace: its text and finish, the model header, the params and the prompt, the
    timing and the cache's anatomy, with `extras` (Extras) from the plan."""
    extras = extras or Extras()
    compile, probe = extras.compile, extras.probe
    full = row.detok.emitted
    cut = row.held.cut
    if cut is not None:
        text = full[:cut]
    elif row.text_before_eos is not None:
        text = row.text_before_eos
    else:
        text = full
    finish = finish_reason(row.text_before_eos is not None, cut is not None, bool(row.steps), openai=True)
    times = [s.time_ms for s in row.steps]
    fields, choices = constrained.summaries(lm, ids, params, row.steps, text)
    model = lm.record()
    if compile:  # what ran compiled (lmtrace.decode.static), as a kernel path is named
        model["config"] = {**model["config"], "compile": compile}
    return new_trace(
        row.steps,
        text=text,
        finish_reason=finish,
        stop_reason=row.stop_reason,
        model=model,
        params={**params.to_dict(), "chat": chat, **({"compile": True} if compile else {}), **inside.params(lm, probe)},
        prompt={"text": prompt, "token_ids": ids, **_templated(lm, ids, chat), **inside.prompt_tokens(lm, probe, ids)},
        timing=timing(times, len(ids)),
        kv_anatomy=anatomy(lm, row.steps),
        prompt_logprobs=row.prompt_logprobs,
        fields=fields,
        choices=choices,
        entries=observers.summaries(extras.watchers, row.steps),
    )


def _measured(kv: dict[str, Any]) -> int:
    """Bytes holding tokens: what the formula predicts (a static cache allocates more)."""
    return kv.get("bytes_used", kv["bytes"])


def anatomy(lm: LM, steps: list[Step]) -> dict[str, Any] | None:
    """The header's explanation of the cache, with the steps where measurement and formula differ."""
    layers = steps[0].kv.get("layers") if steps else None
    batch = layers[0]["keys"][0] if layers and layers[0]["keys"] else 1  # rows decoded together
    try:
        an = size.anatomy(lm.model.config, lm.summary.dtype or "float32", batch)
    except InvalidParameter as e:
        return {"unsupported": str(e)}
    d = an.to_dict()
    d["mismatches"] = [s.index for s in steps if _measured(s.kv) != s.kv.get("expected_bytes", _measured(s.kv))]
    return d


def seeded(params: SamplingParams) -> SamplingParams:
    """Sampling params with a seed (a random one where none was given), so a trace can be replayed."""
    if params.greedy or params.seed is not None:
        return params
    return make_params(params, seed=random.randrange(2**31))


def record(
    lm: LM, row: RowState, bs: BatchStep, r: int, kv: dict[str, Any], choose_ms: float, tb: TokenBytes,
    hit: bool | None = None, forward_ms: float | None = None,
) -> bool:  # fmt: skip
    """Row `row`'s Step from row `r` of the batch step, with `kv` its own part of the cache;
    calls its `on_step`. True when the row leaves: it finished (its trace is set) or its
    consumer raised (its `error` is set). `hit`: the loop already fed the token to the row's
    record (its hook), and whether it completed a stop string. `forward_ms`: the time of the
    forward that made this step's logits, where `row.step_ms` has moved on to the next one."""
    if row.error is not None:  # its grammar allowed nothing: it leaves without this step
        return True
    token, p = bs.token_ids[r], row.params
    is_eos = p.stop_on_eos and token in lm.eos_token_ids
    if hit is None:
        hit = row.add(token, is_eos)
    finish = finish_reason(is_eos, hit, row.index == p.max_new_tokens - 1)
    piece = row.closing(finish, token)
    bs.index = row.index
    bs.time_ms = (row.step_ms if forward_ms is None else forward_ms) + choose_ms
    step = step_record(lm, bs, r, piece, tb)
    step.kv = kv
    if row.index == 0 and row.cached:
        step.kv = {**kv, "cached_tokens": row.cached}
    row.steps.append(step)
    row.index += 1
    stopped = None
    try:
        if row.spec.on_step is not None:
            row.spec.on_step(step)
    except StopRow as e:  # the row's consumer ended it early: it leaves with its trace
        stopped = e.reason
    except BaseException as e:  # the row's consumer stopped it: it alone leaves
        row.error = e
        return True
    if finish is not None or stopped is not None:
        s = row.spec
        probe = inside.Probe([s.ids], p.top_logprobs, s.lens, s.attention) if s.lens or s.attention else None
        row.trace = to_trace(lm, s.text, s.ids, p, row, s.chat, Extras(probe=probe, watchers=s.observers))
        row.trace.timing["cached_tokens"] = row.cached
        if s.logits_processors:  # as generate names them: the user's processors that ran, in order
            row.trace.params["logits_processors"] = [u.name for u in s.logits_processors]
        if stopped is not None and finish is None:
            row.trace.finish_reason = stopped
        return True
    return False
