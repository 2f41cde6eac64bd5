"""Turns the engine's numbers into records: text pieces, stop strings, timing, the Trace.
The three depths of the API: generate_steps (numbers), stream (Steps), generate (Trace)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lmtrace import engine, forced, inside, kvsize, rowkv, sampling
from lmtrace import waterfall as waterfall_mod
from lmtrace.detokenize import IncrementalDetokenizer, TokenBytes
from lmtrace.loading import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Alternative, Step, Trace
from lmtrace.versions import versions


def make_params(params: SamplingParams | None = None, **kwargs: Any) -> SamplingParams:
    if params is not None and kwargs:
        merged = {**params.to_dict(), **kwargs}
        return SamplingParams.from_dict(merged)
    return params if params is not None else SamplingParams(**kwargs)


def encode_prompt(lm: LM, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt; with `chat` the tokenizer's chat template wraps a user message."""
    tok = lm.tokenizer
    if chat:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(prompt)["input_ids"])


class _Row:
    """Per-prompt state: its detokenizer, its steps, where a stop string cut the text."""

    def __init__(self, lm: LM, stops: Sequence[str]):
        self.detok = IncrementalDetokenizer(lm.tokenizer)
        self.stops = stops
        self.steps: list[Step] = []
        self.piece = ""
        self.cut: int | None = None
        self.stop_reason: str | int | None = None
        self.text_before_eos: str | None = None
        self.prompt_logprobs: list | None = None  # with echo: the prompt's TokenScores

    def add(self, token_id: int, is_eos: bool) -> bool:
        """Feeds a token; True when a stop string is now complete."""
        before = self.detok.emitted
        if is_eos:  # the answer's text ends before the end token, held-back bytes included
            self.text_before_eos = self.detok.tokenizer.decode(self.detok.ids)
        self.piece = self.detok.add(token_id)
        if is_eos or not self.stops:
            return False
        text = self.detok.emitted
        start = max(0, len(before) - max(len(s) for s in self.stops))
        hits = [(text.find(s, start), s) for s in self.stops if text.find(s, start) >= 0]
        if hits:
            self.cut, self.stop_reason = min(hits)
            return True
        return False


def _step(lm: LM, bs: engine.BatchStep, row: int, piece: str, tb: TokenBytes) -> Step:
    top = [
        Alternative(t, tb.text(t), list(tb(t)), lp, slp)
        for t, lp, slp in zip(bs.top_ids[row], bs.top_logprobs[row], bs.top_sampled_logprobs[row])
    ]
    token = bs.token_ids[row]
    return Step(
        index=bs.index,
        token_id=token,
        text=piece,
        bytes=list(tb(token)),
        logprob=bs.logprob[row],
        sampled_logprob=bs.sampled_logprob[row],
        rank=bs.rank[row],
        entropy=bs.entropy[row],
        sampled_entropy=bs.sampled_entropy[row],
        top=top,
        kv=bs.kv.to_dict(),
        time_ms=bs.time_ms,
        waterfall=waterfall_mod.with_texts(bs.waterfall[row], tb.text) if bs.waterfall else None,
        lens=inside.with_texts(bs.lens[row], tb.text) if bs.lens else None,
        attention=inside.with_texts(bs.attention[row], tb.text) if bs.attention else None,
    )


def _rng(lm: LM, params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    return torch.Generator(device=lm.model.device).manual_seed(params.seed)


def _iter_rows(
    lm: LM,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    rows: list[_Row],
    echo: bool = False,
    waterfall_at: Callable[[int], bool] | None = None,
    compile: bool = False,
    rng: sampling.Rng = None,
    probe: inside.Probe | None = None,
) -> Iterator[tuple[int, Step]]:
    """Runs the engine and yields (row, Step) for every row still generating at each step.
    `rng` None means one generator seeded by `params.seed`."""
    eos = set(lm.eos_token_ids) if params.stop_on_eos else set()

    def hook(row: int, token: int) -> bool:
        return rows[row].add(token, token in eos)

    rng = rng if rng is not None else _rng(lm, params)
    steps = engine.generate_steps(
        lm.model,
        prompts,
        params,
        rng,
        sorted(eos),
        lm.pad_token_id,
        hook,
        echo=echo,
        waterfall_at=waterfall_at,
        compile=compile,
        probe=probe,
    )
    yield from _records(lm, prompts, steps, rows)


def _records(
    lm: LM, prompts: Sequence[list[int]], steps: Iterator[engine.BatchStep], rows: list[_Row]
) -> Iterator[tuple[int, Step]]:
    """The engine's BatchSteps as (row, Step) records; `rows` were fed each token by the hook."""
    tb = TokenBytes(lm.tokenizer)
    for bs in steps:
        if bs.prompt is not None:
            for ids, state, numbers in zip(prompts, rows, bs.prompt):
                state.prompt_logprobs = forced.token_scores(lm.tokenizer, ids, 0, numbers, tb)
        for r, state in enumerate(rows):
            if not bs.active[r]:
                continue
            piece = state.piece + (state.detok.flush() if bs.finish[r] else "")
            if bs.finish[r] == "eos":
                state.stop_reason = bs.token_ids[r]
            step = _step(lm, bs, r, piece, tb)
            state.steps.append(step)
            yield r, step


def _trace(
    lm: LM,
    prompt: str,
    ids: list[int],
    params: SamplingParams,
    row: _Row,
    chat: bool,
    compile: bool = False,
    probe: inside.Probe | None = None,
) -> Trace:
    full = row.detok.emitted
    if row.cut is not None:
        text = full[: row.cut]
    elif row.text_before_eos is not None:
        text = row.text_before_eos
    else:
        text = full
    last = row.steps[-1] if row.steps else None
    finish = "length" if last is not None and row.cut is None and row.text_before_eos is None else "stop"
    times = [s.time_ms for s in row.steps]
    decode_ms = sum(times[1:])
    summary = lm.summary.to_dict()
    return Trace(
        model={"source": lm.source, "config": summary, "dtype": summary["dtype"], "device": summary["device"]},
        params={**params.to_dict(), "chat": chat, **({"compile": True} if compile else {}), **inside.params(lm, probe)},
        prompt={"text": prompt, "token_ids": ids, **inside.prompt_tokens(lm, probe, ids)},
        text=text,
        token_ids=[s.token_id for s in row.steps],
        finish_reason=finish,
        stop_reason=row.stop_reason,
        timing={
            "prefill_ms": times[0] if times else 0.0,
            "decode_ms": decode_ms,
            "total_ms": sum(times),
            "prompt_tokens": len(ids),
            "generated_tokens": len(times),
            "prefill_tokens_per_s": len(ids) / (times[0] / 1000) if times and times[0] > 0 else None,
            "decode_tokens_per_s": (len(times) - 1) / (decode_ms / 1000) if decode_ms > 0 else None,
        },
        versions=versions(),
        steps=row.steps,
        kv_anatomy=_anatomy(lm, row.steps),
        prompt_logprobs=row.prompt_logprobs,
    )


def _measured(kv: dict[str, Any]) -> int:
    """Bytes holding tokens: what the formula predicts (a static cache allocates more)."""
    return kv.get("bytes_used", kv["bytes"])


def _anatomy(lm: LM, steps: list[Step]) -> dict[str, Any] | None:
    """The header's explanation of the cache, with the steps where measurement and formula differ."""
    layers = steps[0].kv.get("layers") if steps else None
    batch = layers[0]["keys"][0] if layers and layers[0]["keys"] else 1  # rows decoded together
    try:
        an = kvsize.anatomy(lm.model.config, lm.summary.dtype or "float32", batch)
    except kvsize.InvalidParameter as e:
        return {"unsupported": str(e)}
    d = an.to_dict()
    d["mismatches"] = [s.index for s in steps if _measured(s.kv) != s.kv.get("expected_bytes", _measured(s.kv))]
    return d


def _seeded(params: SamplingParams) -> SamplingParams:
    if params.greedy or params.seed is not None:
        return params
    return make_params(params, seed=random.randrange(2**31))


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
    **kwargs: Any,
) -> Trace | list[Trace]:
    """Traces a generation. A list of prompts decodes as one left-padded batch and gives a
    list of Traces; `on_step(row, step)` is called as each step is produced. `echo` also
    records the prompt's own tokens (`trace.prompt_logprobs`, from the prefill pass);
    `waterfall` (a step index or "all") records the distribution after each sampling stage;
    `compile` uses a static cache and a torch.compile'd decode step (a one-off compile);
    `lens` records every layer's prediction at each step (the logit lens) and `attention` what
    each step's token attended to in the cache, the mean over heads (True) and also each head
    ("heads") (lmtrace.lens, lmtrace.attention)."""
    p = _seeded(make_params(params, **kwargs))
    inside.check(compile, lens, attention)
    selector = waterfall_mod.step_selector(waterfall, p.max_new_tokens)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    ids = [encode_prompt(lm, text, chat) for text in prompts]
    rows = [_Row(lm, p.stop) for _ in ids]
    probe = inside.Probe(ids, p.top_logprobs, lens, attention)
    for r, step in _iter_rows(lm, ids, p, rows, echo, selector, compile, probe=probe):
        if on_step is not None:
            on_step(r, step)
    traces = [_trace(lm, text, i, p, row, chat, compile, probe) for text, i, row in zip(prompts, ids, rows)]
    return traces[0] if isinstance(prompt, str) else traces


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
) -> list[Trace]:
    """Decodes prompts (their text and token ids) as one left-padded batch, each row as it would
    decode alone: one generator per row seeded by its own params' seed, and each step's `kv` the
    row's own part of the cache (no padding, batch 1). The rows' params may differ only in seed.
    `lens` and `attention` as in generate."""
    ps = [_seeded(p) for p in params]
    shared = ps[0]
    if any({**p.to_dict(), "seed": None} != {**shared.to_dict(), "seed": None} for p in ps):
        raise ValueError("generate_each: the rows' params may differ only in their seed")
    rng = None if shared.greedy else [_rng(lm, p) for p in ps]
    rows = [_Row(lm, shared.stop) for _ in prompt_ids]
    probe = inside.Probe(prompt_ids, shared.top_logprobs, lens, attention)
    for r, step in _iter_rows(lm, prompt_ids, shared, rows, rng=rng, probe=probe):
        if on_step is not None:
            on_step(r, step)
    width, expected = max(len(i) for i in prompt_ids), engine.expected_bytes(lm.model, 1)
    traces = []
    for text, ids, p, row in zip(prompts, prompt_ids, ps, rows):
        for step in row.steps:
            step.kv = rowkv.own_part(step.kv, width - len(ids), len(rows), expected)
        traces.append(_trace(lm, text, ids, p, row, chat, probe=probe))
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
    **kwargs: Any,
) -> Iterator[Step]:
    """Steps with text and timing, as they are produced (`lens`, `attention` as in generate)."""
    p = _seeded(make_params(params, **kwargs))
    selector = waterfall_mod.step_selector(waterfall, p.max_new_tokens)
    ids = encode_prompt(lm, prompt, chat)
    probe = inside.Probe([ids], p.top_logprobs, lens, attention)
    for _, step in _iter_rows(lm, [ids], p, [_Row(lm, p.stop)], waterfall_at=selector, probe=probe):
        yield step


def generate_steps(
    lm: LM, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None, **kwargs: Any
) -> Iterator[engine.BatchStep]:
    """The engine's numbers for a batch of token-id prompts: no text, no records."""
    p = _seeded(make_params(params, **kwargs))
    eos = sorted(lm.eos_token_ids) if p.stop_on_eos else []
    yield from engine.generate_steps(lm.model, prompt_ids, p, _rng(lm, p), eos, lm.pad_token_id)


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
    **kwargs: Any,
) -> list[Trace]:
    """Like `generate` for prompts already tokenized (a server's token-id prompts, a chat
    template applied by the caller): one left-padded batch, one Trace per prompt. An exception
    raised by `on_step` stops the generation (a server uses this when its client goes away)."""
    p = _seeded(make_params(params, **kwargs))
    ids = [list(i) for i in prompt_ids]
    texts = list(prompt_texts) if prompt_texts is not None else [lm.tokenizer.decode(i) for i in ids]
    rows = [_Row(lm, p.stop) for _ in ids]
    probe = inside.Probe(ids, p.top_logprobs, lens, attention)
    for r, step in _iter_rows(lm, ids, p, rows, probe=probe):
        if on_step is not None:
            on_step(r, step)
    return [_trace(lm, text, i, p, row, chat, probe=probe) for text, i, row in zip(texts, ids, rows)]
