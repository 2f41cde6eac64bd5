"""The three depths of the API over the engine: generate_steps (numbers), stream (Steps),
generate (Trace); and generate_each / generate_ids for batches of token-id prompts."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lmtrace import arguments
from lmtrace.decode import attribution as attributing
from lmtrace.decode import constrained, engine, speculative, static, static_loop
from lmtrace.decode.observers import Observer, build, checked
from lmtrace.decode.rows import RowRecord, generator, make_params, records, seeded, to_trace
from lmtrace.decode.step import BatchStep
from lmtrace.decode.uncertainty import Uncertainty, observer_for
from lmtrace.inside import probe as inside
from lmtrace.kv import rows as kv_rows
from lmtrace.logits import processors, sampling
from lmtrace.model import draft as drafts
from lmtrace.model.invariant import mode as invariant_mode
from lmtrace.model.lm import LM, require_chat_template
from lmtrace.params import SamplingParams
from lmtrace.records import Step, Trace

__all__ = ["encode_prompt", "generate", "generate_each", "generate_ids", "generate_steps", "make_params", "stream"]


def encode_prompt(lm: LM, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt; with `chat` the tokenizer's chat template wraps a user message."""
    tok = lm.tokenizer
    if chat:
        require_chat_template(lm)
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(prompt)["input_ids"])


def _iter_rows(
    lm: LM,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    rows: list[RowRecord],
    watchers: Sequence[Observer] = (),
    compile: bool = False,
    rng: sampling.Rng = None,
    user: Sequence[processors.UserProcessor] = (),
) -> Iterator[tuple[int, Step]]:
    """Runs the engine and yields (row, Step) for every row still generating at each step.
    `rng` None means one generator for the batch seeded by `params.seed` (as model.generate draws
    a sampled batch: the first row draws as it would alone); on a batch-invariant model, one such
    generator per row, so that every row draws as it would alone."""
    eos = set(lm.eos_token_ids) if params.stop_on_eos else set()

    def hook(row: int, token: int) -> bool:
        return rows[row].add(token, token in eos)

    if rng is None:
        own = invariant_mode.active(lm.model) and not params.greedy and len(prompts) > 1
        rng = [generator(lm, params) for _ in prompts] if own else generator(lm, params)
    grammars = constrained.matchers(lm, [params] * len(prompts))
    setup = engine.Setup(sorted(eos), lm.pad_token_id, hook, compile, list(watchers), grammars, user)
    whole = compile and static.whole_step(params.constraint is not None, user, watchers)
    loop = static_loop.generate_steps if whole else engine.generate_steps
    yield from records(lm, prompts, loop(lm.model, prompts, params, rng, setup), rows)


def compiled(lm: LM, compile: bool, params: SamplingParams, user: Sequence[Any], watchers: Sequence[Observer],
             draft: drafts.Draft | None = None) -> str | None:
    """What `compile` compiles for this generation (the trace's `model.config.compile`; None
    without it); a model torch.compile cannot trace is refused in one line (static.check)."""
    if not compile:
        return None
    static.check(lm.model)
    if draft is not None:
        static.check(draft.model, "draft")
        return static.described(static.DRAFT, lm.model.device)
    whole = static.whole_step(params.constraint is not None, user, watchers)
    return static.described(static.STEP if whole else static.FORWARD, lm.model.device)


def generate(
    lm: LM,
    prompt: str | Sequence[str],
    params: SamplingParams | None = None,
    *,
    chat: bool = False,
    on_step: Callable[[int, Step], None] | None = None,
    echo: bool = False,
    waterfall: int | str | None = None,
    compile: bool = False,
    lens: bool = False,
    attention: bool | str = False,
    draft: str | LM | drafts.Draft | None = None,
    draft_tokens: int = 4,
    observers: Sequence[Observer] = (),
    logits_processors: Sequence[processors.UserFn] = (),
    uncertainty: bool | Uncertainty = False,
    attribution: bool = False,
    against: str | int | None = None,
    **kwargs: Any,
) -> Trace | list[Trace]:
    """Traces a generation. A list of prompts decodes as one left-padded batch and gives a
    list of Traces; `on_step(row, step)` is called as each step is produced. `draft` decodes
    speculatively (decode/speculative.py): "packed" (the target GGUF's own 4-bit weights),
    "layers:N" (the target's first N layers), a path / hub id or an LM with the same tokenizer,
    proposing `draft_tokens` tokens a block (with `compile`, the draft's step is the compiled
    one); the steps' numbers stay the target's, each step gets
    `draft` and the trace `speculative` (with a draft, prompts decode one after another). `echo` also
    records the prompt's own tokens (`trace.prompt_logprobs`, from the prefill pass);
    `waterfall` (a step index or "all") records the distribution after each sampling stage;
    `compile` decodes with the static, compiled step (decode/static.py: a preallocated cache, the
    forward and the step's numbers in one torch.compile'd function, CUDA graphs on a GPU; a one-off
    compile), named in the trace's `model.config.compile`;
    `lens` records every layer's prediction at each step (the logit lens) and `attention` what
    each step's token attended to in the cache, the mean over heads (True) and also each head
    ("heads") (lmtrace.inside.lens, lmtrace.inside.attention). `observers`: your own
    lmtrace.Observer instances, each writing its entry at every step (`step.NAME`) and, where it
    summarizes, on the trace (`trace.NAME`). `logits_processors`: your own callables
    `fn(token_ids, logits) -> logits` (a row's tokens generated so far, its (vocab,) float32
    logits), run before the built-in processors, named in the trace's params and the waterfall.
    `uncertainty` (True, or an Uncertainty with its own k, window and tail) records each step's
    `uncertainty` and the trace's (decode/uncertainty.py). `attribution` splits each step's logit
    difference between the chosen token and `against` ("rank:N", default rank:2 the runner-up, a
    token id or a token's text) over the embedding, every layer's attention and MLP, and every head
    (`step.attribution`, lmtrace.inside.attribution)."""
    p = seeded(make_params(params, **kwargs))
    inside.check(compile, lens, attention)
    chosen = _draft(lm, draft, draft_tokens, lens, attention)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    ids = [encode_prompt(lm, text, chat) for text in prompts]
    probe = inside.Probe(ids, p.top_logprobs, lens, attention)
    own = checked([*observers, *observer_for(uncertainty, lm.model.config.vocab_size)])
    own += attributing.wanted(lm, attribution, against, draft=draft, compile=compile)
    user = processors.user_processors(logits_processors)
    # the attribution observes before the lens, which runs the final norm again (the norm's hook
    # would keep the lens's input instead of the forward's)
    watchers = own + build(probe, echo=echo, waterfall=waterfall, max_new_tokens=p.max_new_tokens, top_n=p.top_logprobs)
    kind = compiled(lm, compile, p, user, watchers, chosen)
    rows = [RowRecord(lm, p.stop) for _ in ids]
    tallies: dict[int, speculative.Tally] = {}
    if chosen is not None:
        produced = speculative.iter_rows(lm, chosen, ids, p, rows, draft_tokens, watchers, compile, user)
    else:
        produced = ((r, step, None) for r, step in _iter_rows(lm, ids, p, rows, watchers, compile, user=user))
    for r, step, tally in produced:
        if tally is not None:
            tallies[r] = tally
        if on_step is not None:
            on_step(r, step)
    traces = [to_trace(lm, text, i, p, row, chat, kind, probe, own) for text, i, row in zip(prompts, ids, rows)]
    _name_processors(traces, user)
    for r, tally in tallies.items():  # a row's speculative summary: its draft, acceptance, forwards
        traces[r].speculative = tally.to_dict()
    return traces[0] if isinstance(prompt, str) else traces


def _name_processors(traces: Sequence[Trace], user: Sequence[processors.UserProcessor]) -> None:
    """The trace's params name the user's processors that ran (in their order)."""
    if user:
        for trace in traces:
            trace.params["logits_processors"] = [u.name for u in user]


def _draft(lm: LM, draft: Any, k: int, lens: bool = False, attention: bool | str = False) -> drafts.Draft | None:
    """The draft model asked for (None: plain decoding), its arguments checked."""
    if draft is None:
        return None
    arguments.draft_tokens(k)
    arguments.draft_alone(lens, attention)
    return drafts.draft_for(lm, draft)


def generate_each(
    lm: LM,
    prompts: Sequence[str],
    prompt_ids: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    chat: bool = False,
    on_step: Callable[[int, Step], None] | None = None,
    lens: bool = False,
    attention: bool | str = False,
    observers: Sequence[Observer] = (),
) -> list[Trace]:
    """Decodes prompts (their text and token ids) as one left-padded batch, each row as it would
    decode alone: one generator per row seeded by its own params' seed, and each step's `kv` the
    row's own part of the cache (no padding, batch 1). The rows' params may differ only in seed.
    `lens`, `attention` and `observers` as in generate."""
    ps = [seeded(p) for p in params]
    shared = ps[0]
    if any({**p.to_dict(), "seed": None} != {**shared.to_dict(), "seed": None} for p in ps):
        raise ValueError("generate_each: the rows' params may differ only in their seed")
    rng = None if shared.greedy else [generator(lm, p) for p in ps]
    rows = [RowRecord(lm, shared.stop) for _ in prompt_ids]
    probe = inside.Probe(prompt_ids, shared.top_logprobs, lens, attention)
    own = checked(observers)
    for r, step in _iter_rows(lm, prompt_ids, shared, rows, build(probe) + own, rng=rng):
        if on_step is not None:
            on_step(r, step)
    width, expected = max(len(i) for i in prompt_ids), engine.expected_bytes(lm.model, 1)
    traces = []
    for text, ids, p, row in zip(prompts, prompt_ids, ps, rows):
        for step in row.steps:
            step.kv = kv_rows.own_part(step.kv, width - len(ids), len(rows), expected)
        traces.append(to_trace(lm, text, ids, p, row, chat, probe=probe, watchers=own))
    return traces


def stream(
    lm: LM,
    prompt: str,
    params: SamplingParams | None = None,
    *,
    chat: bool = False,
    waterfall: int | str | None = None,
    lens: bool = False,
    attention: bool | str = False,
    draft: str | LM | drafts.Draft | None = None,
    draft_tokens: int = 4,
    observers: Sequence[Observer] = (),
    logits_processors: Sequence[processors.UserFn] = (),
    uncertainty: bool | Uncertainty = False,
    attribution: bool = False,
    against: str | int | None = None,
    compile: bool = False,
    **kwargs: Any,
) -> Iterator[Step]:
    """Steps with text and timing, as they are produced (`lens`, `attention`, `draft`, `observers`,
    `logits_processors`, `uncertainty`, `attribution`, `compile` as in generate; a stream has no
    trace, so each observer's step entries come, its trace-level summary does not)."""
    p = seeded(make_params(params, "stream", **kwargs))
    inside.check(compile, lens, attention)
    chosen = _draft(lm, draft, draft_tokens, lens=lens, attention=attention)
    ids = encode_prompt(lm, prompt, chat)
    probe = inside.Probe([ids], p.top_logprobs, lens, attention)
    watchers = attributing.wanted(lm, attribution, against, draft=draft, compile=compile)  # first: as in generate
    watchers += build(probe, waterfall=waterfall, max_new_tokens=p.max_new_tokens, top_n=p.top_logprobs)
    watchers += checked([*observers, *observer_for(uncertainty, lm.model.config.vocab_size)])
    user = processors.user_processors(logits_processors)
    compiled(lm, compile, p, user, watchers, chosen)
    if chosen is not None:
        for _, step, _tally in speculative.iter_rows(lm, chosen, [ids], p, [RowRecord(lm, p.stop)], draft_tokens,
                                                     watchers, compile, user=user):  # fmt: skip
            yield step
        return
    for _, step in _iter_rows(lm, [ids], p, [RowRecord(lm, p.stop)], watchers, compile, user=user):
        yield step


def generate_steps(
    lm: LM, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None, **kwargs: Any
) -> Iterator[BatchStep]:
    """The engine's numbers for a batch of token-id prompts: no text, no records."""
    p = seeded(make_params(params, **kwargs))
    eos = sorted(lm.eos_token_ids) if p.stop_on_eos else []
    setup = engine.Setup(eos, lm.pad_token_id, grammars=constrained.matchers(lm, [p] * len(prompt_ids)))
    yield from engine.generate_steps(lm.model, prompt_ids, p, generator(lm, p), setup)


def generate_ids(
    lm: LM,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams | None = None,
    *,
    prompt_texts: Sequence[str] | None = None,
    chat: bool = False,
    on_step: Callable[[int, Step], None] | None = None,
    lens: bool = False,
    attention: bool | str = False,
    draft: str | LM | drafts.Draft | None = None,
    draft_tokens: int = 4,
    observers: Sequence[Observer] = (),
    logits_processors: Sequence[processors.UserFn] = (),
    **kwargs: Any,
) -> list[Trace]:
    """Like `generate` for prompts already tokenized (a server's token-id prompts, a chat
    template applied by the caller): one left-padded batch, one Trace per prompt. An exception
    raised by `on_step` stops the generation (a server uses this when its client goes away).
    `draft`, `observers` and `logits_processors` as in generate."""
    p = seeded(make_params(params, "generate_ids", **kwargs))
    chosen = _draft(lm, draft, draft_tokens, lens=lens, attention=attention)
    own, user = checked(observers), processors.user_processors(logits_processors)
    ids = [list(i) for i in prompt_ids]
    texts = list(prompt_texts) if prompt_texts is not None else [lm.tokenizer.decode(i) for i in ids]
    rows = [RowRecord(lm, p.stop) for _ in ids]
    probe = inside.Probe(ids, p.top_logprobs, lens, attention)
    tallies: dict[int, speculative.Tally] = {}
    if chosen is not None:
        produced = speculative.iter_rows(lm, chosen, ids, p, rows, draft_tokens, own, user=user)
    else:
        produced = ((r, step, None) for r, step in _iter_rows(lm, ids, p, rows, build(probe) + own, user=user))
    for r, step, tally in produced:
        if tally is not None:
            tallies[r] = tally
        if on_step is not None:
            on_step(r, step)
    traces = [to_trace(lm, text, i, p, row, chat, probe=probe, watchers=own) for text, i, row in zip(texts, ids, rows)]
    _name_processors(traces, user)
    for r, tally in tallies.items():
        traces[r].speculative = tally.to_dict()
    return traces
