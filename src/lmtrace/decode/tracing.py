"""The three depths of the API over the engine: generate_steps (numbers), stream (Steps),
generate (Trace); and generate_each / generate_ids for batches of token-id prompts. Each builds
one GenerateOptions (decode/options.py) from its keyword arguments, and all of them run one plan
through one `run`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lmtrace.decode import constrained, engine, speculative, static, static_loop
from lmtrace.decode.options import GenerateOptions, Plan, plan
from lmtrace.decode.row_state import Extras, RowState, generator, make_params, records, seeded, to_trace
from lmtrace.decode.step import BatchStep
from lmtrace.errors import InvalidParameter
from lmtrace.kv import row_part
from lmtrace.logits import sampling
from lmtrace.model.invariant import mode as invariant_mode
from lmtrace.model.lm import LM, require_chat_template
from lmtrace.params import SamplingParams
from lmtrace.records import Step, Trace

__all__ = [
    "GenerateOptions",
    "encode_prompt",
    "generate",
    "generate_each",
    "generate_ids",
    "generate_steps",
    "make_params",
    "run",
    "stream",
]


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


OnStep = Callable[[int, Step], None]
# what an entry point cannot do, refused in one line naming it: a stream yields generated steps (no
# trace for the prompt's logprobs); generate_each's rows draw from generators of their own, which a
# draft's one-row-after-another decoding does not keep
STREAM_REFUSES = ("echo",)
EACH_REFUSES = ("draft",)


def _iter_rows(
    lm: LM, prompts: Sequence[list[int]], plan: Plan, rows: list[RowState], rng: Any = None
) -> Iterator[tuple[int, Step]]:
    """Runs the engine and yields (row, Step) for every row still generating at each step.
    `rng` None means one generator for the batch seeded by the params' seed (as model.generate
    draws a sampled batch: the first row draws as it would alone); on a batch-invariant model, one
    such generator per row, so that every row draws as it would alone."""
    params, compile = plan.params, plan.options.compile
    eos = set(lm.eos_token_ids) if params.stop_on_eos else set()

    def hook(row: int, token: int) -> bool:
        return rows[row].add(token, token in eos)

    if rng is None:
        own = invariant_mode.active(lm.model) and not params.greedy and len(prompts) > 1
        rng = [generator(lm, params) for _ in prompts] if own else generator(lm, params)
    grammars = constrained.matchers(lm, [params] * len(prompts))
    setup = engine.Setup(sorted(eos), lm.pad_token_id, hook, compile, list(plan.watchers), grammars, plan.user)
    whole = compile and static.whole_step(params.constraint is not None, plan.user, plan.watchers)
    loop = static_loop.generate_steps if whole else engine.generate_steps
    yield from records(lm, prompts, loop(lm.model, prompts, params, rng, setup), rows)


def produced(
    lm: LM, plan: Plan, ids: Sequence[list[int]], rows: list[RowState], rng: sampling.Rng = None
) -> Iterator[tuple[int, Step, speculative.Tally | None]]:
    """(row, Step, the row's speculative Tally or None) as the steps come: the prompts decoded as
    one batch, or with a draft one after another (decode/speculative.py)."""
    if plan.draft is not None:
        yield from speculative.iter_rows(lm, plan, ids, rows)
        return
    for r, step in _iter_rows(lm, ids, plan, rows, rng):
        yield r, step, None


def run(
    lm: LM,
    options: GenerateOptions,
    texts: Sequence[str],
    ids: Sequence[list[int]],
    on_step: OnStep | None = None,
) -> list[Trace]:
    """One Trace per prompt (`texts` and their token `ids`), decoded as `options` ask;
    `on_step(row, step)` is called as each step is produced (an exception it raises stops the
    generation)."""
    the_plan = plan(lm, options, ids)
    rows = [RowState(lm, the_plan.params) for _ in ids]
    tallies: dict[int, speculative.Tally] = {}
    for r, step, tally in produced(lm, the_plan, ids, rows):
        if tally is not None:
            tallies[r] = tally
        if on_step is not None:
            on_step(r, step)
    traces = traced(lm, the_plan, texts, ids, rows)
    for r, tally in tallies.items():  # a row's speculative summary: its draft, acceptance, forwards
        traces[r].speculative = tally.to_dict()
    return traces


def traced(
    lm: LM,
    plan: Plan,
    texts: Sequence[str],
    ids: Sequence[list[int]],
    rows: Sequence[RowState],
    params: Sequence[SamplingParams] | None = None,
) -> list[Trace]:
    """Each row's Trace (with `params`, each row's own), naming the user's processors that ran."""
    o, ps = plan.options, params or [plan.params] * len(rows)
    traces = [
        to_trace(lm, text, i, p, row, o.chat, Extras(plan.kind, plan.probe, plan.own))
        for text, i, p, row in zip(texts, ids, ps, rows)
    ]
    if plan.user:
        for trace in traces:
            trace.params["logits_processors"] = [u.name for u in plan.user]
    return traces


def generate(
    lm: LM,
    prompt: str | Sequence[str],
    params: SamplingParams | None = None,
    *,
    on_step: OnStep | None = None,
    options: GenerateOptions | None = None,
    **kwargs: Any,
) -> Trace | list[Trace]:
    """Traces a generation. A list of prompts decodes as one left-padded batch and gives a
    list of Traces; `on_step(row, step)` is called as each step is produced. The keyword
    arguments are the sampling settings (lmtrace.SamplingParams: max_new_tokens, temperature,
    top_k, top_p, seed, stop, regex, ...) and the options (lmtrace.GenerateOptions), or pass
    `options` whole: `chat` wraps the prompt in the chat template; `draft` decodes speculatively
    (decode/speculative.py): "packed" (the target GGUF's own 4-bit weights), "layers:N" (the
    target's first N layers), a path / hub id or an LM with the same tokenizer, proposing
    `draft_tokens` tokens a block (with `compile`, the draft's step is the compiled one); the
    steps' numbers stay the target's, each step gets `draft` and the trace `speculative` (with a
    draft, prompts decode one after another). `echo` also records the prompt's own tokens
    (`trace.prompt_logprobs`, from the prefill pass); `waterfall` (a step index or "all") records
    the distribution after each sampling stage; `compile` decodes with the static, compiled step
    (decode/static.py: a preallocated cache, the forward and the step's numbers in one
    torch.compile'd function, CUDA graphs on a GPU; a one-off compile), named in the trace's
    `model.config.compile`; `lens` records every layer's prediction at each step (the logit lens)
    and `attention` what each step's token attended to in the cache, the mean over heads (True)
    and also each head ("heads") (lmtrace.inside.lens, lmtrace.inside.attention). `observers`:
    your own lmtrace.Observer instances, each writing its entry at every step (`step.NAME`) and,
    where it summarizes, on the trace (`trace.NAME`). `logits_processors`: your own callables
    `fn(token_ids, logits) -> logits` (a row's tokens generated so far, its (vocab,) float32
    logits), run before the built-in processors, named in the trace's params and the waterfall.
    `uncertainty` (True, or an Uncertainty with its own k, window and tail) records each step's
    `uncertainty` and the trace's (decode/uncertainty.py). `attribution` splits each step's logit
    difference between the chosen token and `against` ("rank:N", default rank:2 the runner-up, a
    token id or a token's text) over the embedding, every layer's attention and MLP, and every head
    (`step.attribution`, lmtrace.inside.attribution)."""
    o = _options(options, params, "generate", kwargs)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    ids = [encode_prompt(lm, text, o.chat) for text in prompts]
    traces = run(lm, o, prompts, ids, on_step)
    return traces[0] if isinstance(prompt, str) else traces


def _options(
    options: GenerateOptions | None,
    params: SamplingParams | None,
    entry: str,
    kwargs: dict,
    refused: Sequence[str] = (),
) -> GenerateOptions:
    """`options` as given (with no other keyword argument), or built from the keywords."""
    if options is None:
        return GenerateOptions.of(params, entry, refused, **kwargs)
    if params is not None or kwargs:
        given = ", ".join(["params"] * (params is not None) + sorted(kwargs))
        raise InvalidParameter(f"options: {entry} takes options whole or as keyword arguments, not both (got {given})")
    for name in refused:
        if getattr(options, name) != getattr(GenerateOptions(), name):
            raise InvalidParameter(f"{name}: {entry} does not take {name}")
    return options


def generate_each(
    lm: LM,
    prompts: Sequence[str],
    prompt_ids: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    on_step: OnStep | None = None,
    **kwargs: Any,
) -> list[Trace]:
    """Decodes prompts (their text and token ids) as one left-padded batch, each row as it would
    decode alone: one generator per row seeded by its own params' seed, and each step's `kv` the
    row's own part of the cache (no padding, batch 1). The rows' params may differ only in seed.
    The keyword arguments are generate's options (not a draft, which decodes one row after another)."""
    ps = [seeded(p) for p in params]
    shared = ps[0]
    if any({**p.to_dict(), "seed": None} != {**shared.to_dict(), "seed": None} for p in ps):
        raise ValueError("generate_each: the rows' params may differ only in their seed")
    o = GenerateOptions.of(shared, "generate_each", EACH_REFUSES, **kwargs)
    the_plan = plan(lm, o, prompt_ids)
    rng = None if shared.greedy else [generator(lm, p) for p in ps]
    rows = [RowState(lm, shared) for _ in prompt_ids]
    for r, step, _ in produced(lm, the_plan, prompt_ids, rows, rng):
        if on_step is not None:
            on_step(r, step)
    width, expected = max(len(i) for i in prompt_ids), engine.expected_bytes(lm.model, 1)
    for ids, row in zip(prompt_ids, rows):
        for step in row.steps:
            step.kv = row_part.own_part(step.kv, width - len(ids), len(rows), expected)
    return traced(lm, the_plan, prompts, prompt_ids, rows, ps)


def stream(
    lm: LM, prompt: str, params: SamplingParams | None = None, *, options: GenerateOptions | None = None, **kwargs: Any
) -> Iterator[Step]:
    """Steps with text and timing, as they are produced (the options as in generate but `echo`;
    a stream has no trace, so each observer's step entries come, its trace-level summary does not)."""
    o = _options(options, params, "stream", kwargs, STREAM_REFUSES)
    ids = encode_prompt(lm, prompt, o.chat)
    the_plan = plan(lm, o, [ids])
    for _, step, _tally in produced(lm, the_plan, [ids], [RowState(lm, the_plan.params)]):
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
    on_step: OnStep | None = None,
    options: GenerateOptions | None = None,
    **kwargs: Any,
) -> list[Trace]:
    """Like `generate` for prompts already tokenized (a server's token-id prompts, a chat
    template applied by the caller, `chat` then only named in the trace's params): one
    left-padded batch, one Trace per prompt. An exception raised by `on_step` stops the generation
    (a server uses this when its client goes away). The options as in generate."""
    o = _options(options, params, "generate_ids", kwargs)
    ids = [list(i) for i in prompt_ids]
    texts = list(prompt_texts) if prompt_texts is not None else [lm.tokenizer.decode(i) for i in ids]
    return run(lm, o, texts, ids, on_step)
