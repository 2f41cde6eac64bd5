"""`lmtrace.from_generate(output, tokenizer)`: Traces of a run of transformers' own
`model.generate(..., return_dict_in_generate=True)`, one per returned sequence.

The raw numbers (logprob, rank, entropy, the alternatives) come from `output.logits`
(`output_logits=True`), the processed ones (sampled_logprob, sampled_entropy) from `output.scores`
(`output_scores=True`); with one of the two the other stays unknown (`trace.distributions` says
which are there). Beam search follows `beam_indices` per returned beam. Assisted generation
(`assistant_model=`) returns the target's numbers per token as plain decoding does; the draft's
proposals, its q and the verdicts are not in the output, and the trace's `speculative` says so."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmtrace.decode import engine
from lmtrace.detokenize import TokenBytes, pieces
from lmtrace.errors import InvalidParameter
from lmtrace.external.generation_config import model_header, params_of, settings_dict, special_ids
from lmtrace.kv import ledger
from lmtrace.kv import size as kvsize
from lmtrace.logits.measure import Numbers
from lmtrace.logits.measure import recorded as measure
from lmtrace.records import Step, Trace
from lmtrace.records.alternatives import alternatives
from lmtrace.records.steps import StepNumbers, new_step
from lmtrace.records.timing import timing
from lmtrace.records.traces import new_trace
from lmtrace.stops import StopStrings, finish_reason

FLAGS = "model.generate(..., return_dict_in_generate=True, output_scores=True, output_logits=True)"
# a model's output layer may be padded past its tokenizer's vocabulary (to a multiple of 64 or 128,
# a few hundred ids at most); further apart, the tokenizer belongs to another model
PADDED_VOCAB = 1024


class _Run:
    """The parts of a generate output this module reads, checked once."""

    def __init__(self, output: Any):
        if isinstance(output, torch.Tensor):
            raise InvalidParameter(f"output: got a tensor of token ids, which holds no scores or logits; call {FLAGS}")
        seqs = getattr(output, "sequences", None)
        if not isinstance(seqs, torch.Tensor) or seqs.dim() != 2:
            raise InvalidParameter(
                f"output: expected what model.generate returns with return_dict_in_generate=True (with "
                f".sequences), got {type(output).__name__}"
            )
        if "EncoderDecoder" in type(output).__name__:
            raise InvalidParameter("output: an encoder-decoder model's output; from_generate reads decoder-only models")
        self.raw = _steps(getattr(output, "logits", None))
        self.processed = _steps(getattr(output, "scores", None))
        if self.raw is None and self.processed is None:
            raise InvalidParameter(f"output: holds neither scores nor logits; call {FLAGS}")
        if self.raw is not None and self.processed is not None and len(self.raw) != len(self.processed):
            raise InvalidParameter(f"output: {len(self.raw)} logits but {len(self.processed)} scores")
        self.seqs = seqs
        self.beams = getattr(output, "beam_indices", None)  # (rows, generated), -1 past a beam's end
        dists = self.raw if self.raw is not None else self.processed
        self.vocab = int(dists[0].shape[-1])
        generated = self.beams.shape[1] if self.beams is not None else len(dists)
        self.prompt_len = seqs.shape[1] - generated
        if self.prompt_len < 0:
            raise InvalidParameter(f"output: {generated} steps of scores but sequences of {seqs.shape[1]} tokens")
        cache = getattr(output, "cache", None)
        self.cache = cache if cache is not None else getattr(output, "past_key_values", None)

    @property
    def distributions(self) -> str:
        return "both" if self.raw is not None and self.processed is not None else ("raw" if self.raw else "processed")


def _steps(found: Any) -> Sequence[torch.Tensor] | None:
    """Per-step (rows, vocab) tensors, or None when generate was not asked for them."""
    if found is None or (isinstance(found, (tuple, list)) and not found):
        return None
    if isinstance(found, torch.Tensor) or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in found):
        raise InvalidParameter("output: scores/logits must be one (rows, vocab) tensor per step, as generate returns")
    return found


def _check_vocab(tokenizer: Any, run: _Run, model: Any) -> None:
    size = len(tokenizer)
    if size > run.vocab or run.vocab - size > PADDED_VOCAB:
        raise InvalidParameter(
            f"tokenizer: has {size} tokens but the model's distributions have {run.vocab}: "
            "it is not this model's tokenizer"
        )
    config_vocab = getattr(getattr(model, "config", None), "vocab_size", None) if model is not None else None
    if config_vocab is not None and int(config_vocab) != run.vocab:
        raise InvalidParameter(f"model: vocab_size {config_vocab}, but the output's distributions have {run.vocab}")
    top = int(run.seqs.max())
    if top >= size:
        raise InvalidParameter(f"tokenizer: has {size} tokens, but the sequences hold token id {top}")


def _row_span(run: _Run, row: int, eos: set[int], pad: int | None) -> tuple[list[int], list[int], str, Any]:
    """(distribution row per step, generated tokens, finish_reason, stop_reason) of one returned row:
    its steps end at its first end token; the pad generate writes after a row's end is no step.
    `pad` is given only where another criterion (stop strings) may have ended a row."""
    tokens = run.seqs[row, run.prompt_len :].tolist()
    if run.beams is not None:
        index = run.beams[row].tolist()
        length = sum(1 for i in index if i >= 0)
        index, tokens = index[:length], tokens[:length]
    else:
        index = [row] * len(tokens)
    end = next((t + 1 for t, token in enumerate(tokens) if token in eos), None)
    is_eos, stopped = end is not None, False
    if not is_eos and pad is not None and tokens and tokens[-1] == pad:
        # a stop string ended this row while others ran on: generate wrote pads after its end
        end, stopped = len(tokens), True
        while end and tokens[end - 1] == pad:
            end -= 1
    finish = finish_reason(is_eos, stopped, True, openai=True)
    return index[:end], tokens[:end], finish, tokens[end - 1] if is_eos else None


def _gather(dists: Sequence[torch.Tensor] | None, index: list[int]) -> torch.Tensor | None:
    if dists is None or not index:
        return None
    return torch.stack([dists[t][i] for t, i in enumerate(index)])  # (steps, vocab)


def _ledger(run: _Run, model: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The cache generate handed back, measured once at the end (not per step), and its anatomy."""
    if run.cache is None or not hasattr(run.cache, "layers"):
        return None, None
    keys = getattr(run.cache.layers[0], "keys", None) if run.cache.layers else None
    batch = int(keys.shape[0]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 1
    expected = engine.expected_bytes(model, batch) if model is not None else None
    measured = ledger.state(run.cache, expected).to_dict()
    measured["measured"] = "end"  # after generate returned: the whole batch's cache, not this step's
    anatomy = None
    if model is not None:
        try:
            dtype = str(next(model.parameters()).dtype).replace("torch.", "")
            anatomy = kvsize.anatomy(model.config, dtype, batch).to_dict()
            anatomy["mismatches"] = [] if measured.get("expected_bytes") in (None, measured["bytes"]) else ["end"]
        except InvalidParameter as e:
            anatomy = {"unsupported": str(e)}
    return measured, anatomy


def records_of(
    tokens: list[int], numbers: Numbers, tokenizer: Any, tb: TokenBytes, ends_at_eos: bool
) -> tuple[list[Step], str]:
    """The records and the text, as lmtrace.generate writes them (the text ends before an end
    token: `ends_at_eos`, the last token is one)."""
    steps, texts = [], pieces(tokenizer, tokens)
    for i, (token, piece) in enumerate(zip(tokens, texts)):
        top = alternatives(numbers.top_ids[i], numbers.top_logprobs[i], numbers.top_sampled_logprobs[i], tb)
        own = StepNumbers(
            numbers.logprob[i],
            numbers.sampled_logprob[i],
            numbers.rank[i],
            numbers.entropy[i],
            numbers.sampled_entropy[i],
        )
        steps.append(new_step(i, token, piece, own, top, tb))
    if ends_at_eos and tokens:  # the text ends before the end token, held-back bytes included
        return steps, tokenizer.decode(tokens[:-1])
    return steps, "".join(texts)


def _cut_at_stop(texts: Sequence[str], stops: Sequence[str]) -> tuple[str, str | None]:
    """The steps' text up to the first stop string to complete, fed step by step as
    lmtrace.generate's row is, and that string; the text whole and None where none does."""
    held = StopStrings(stops)
    for piece in texts:
        if held.feed(piece):
            return held.text[: held.cut], held.stop
    return held.text, None


def _prompt_texts(prompt: str | Sequence[str] | None, rows: int) -> list[str | None]:
    """One prompt text per returned row (num_return_sequences rows share their input's prompt)."""
    if prompt is None:
        return [None] * rows
    given = [prompt] if isinstance(prompt, str) else list(prompt)
    if not given or rows % len(given):
        raise InvalidParameter(f"prompt: {len(given)} prompts do not divide the output's {rows} rows")
    return [given[r // (rows // len(given))] for r in range(rows)]


def _row_trace(run: _Run, row: int, tokenizer: Any, ctx: dict[str, Any]) -> Trace:
    """The Trace of one returned row; `ctx` holds what all rows share."""
    index, tokens, finish, stop_reason = _row_span(run, row, ctx["eos"], ctx["stopped"])
    ids = run.seqs[row, : run.prompt_len].tolist()
    pad = ctx["pad"]
    while pad is not None and len(ids) > 1 and ids[0] == pad:  # generate's left padding
        ids = ids[1:]
    raw, processed = _gather(run.raw, index), _gather(run.processed, index)  # (steps, vocab) each
    numbers = Numbers()
    if raw is not None or processed is not None:
        chosen = torch.tensor(tokens, dtype=torch.long, device=(raw if raw is not None else processed).device)
        numbers = measure(raw, processed, chosen, ctx["top_logprobs"], processed_are_logprobs=run.beams is not None)
    steps, text = records_of(tokens, numbers, tokenizer, ctx["tb"], stop_reason is not None)
    if stop_reason is None and ctx["stops"]:  # a stop string ended it: the text ends before it
        text, stop_reason = _cut_at_stop([s.text for s in steps], ctx["stops"])
    if steps and ctx["ledger"] is not None:
        steps[-1].kv = dict(ctx["ledger"])
    prompt = ctx["texts"][row]
    return new_trace(
        steps,
        text=text,
        finish_reason=finish,
        stop_reason=stop_reason,
        model=dict(ctx["header"]),
        params=dict(ctx["params"]),
        prompt={"text": prompt if prompt is not None else tokenizer.decode(ids), "token_ids": ids},
        timing=timing(None, len(ids), len(tokens)),
        kv_anatomy=ctx["anatomy"],
        origin="model.generate",
        distributions=run.distributions,
    )


def from_generate(
    output: Any,
    tokenizer: Any,
    *,
    model: Any = None,
    generation_config: Any = None,
    prompt: str | Sequence[str] | None = None,
    top_logprobs: int = 5,
    assistant_model: Any = None,
) -> list[Trace]:
    """One Trace per returned sequence of `model.generate(..., return_dict_in_generate=True,
    output_scores=True, output_logits=True)` (rows x num_return_sequences, in generate's order).

    `model` (optional) adds the architecture to the header and checks the final KV cache against
    the formula; `generation_config` (a GenerationConfig or the dict of keyword arguments given to
    generate) records the settings; `prompt` the prompt text(s) (else decoded from the sequences,
    left padding removed); `assistant_model` the draft given to generate for assisted generation
    (also read from a `generation_config` dict's `assistant_model`)."""
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 100:
        raise InvalidParameter(f"top_logprobs must be an integer in [0, 100], got {top_logprobs!r}")
    run = _Run(output)
    _check_vocab(tokenizer, run, model)
    eos, pad = special_ids(tokenizer, generation_config, model)
    ledger, anatomy = _ledger(run, model)
    dists = run.raw if run.raw is not None else run.processed
    stops = settings_dict(generation_config).get("stop_strings") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    ctx = {
        "eos": eos,
        "pad": pad,
        # only where a stop string may have ended a row are the pads at its end not steps
        "stopped": pad if stops else None,
        "stops": stops,
        "top_logprobs": top_logprobs,
        "tb": TokenBytes(tokenizer),
        "ledger": ledger,
        "anatomy": anatomy,
        "texts": _prompt_texts(prompt, run.seqs.shape[0]),
        "header": model_header(model, tokenizer, dists[0]),
        "params": params_of(generation_config, len(dists), top_logprobs),
    }
    traces = [_row_trace(run, row, tokenizer, ctx) for row in range(run.seqs.shape[0])]
    assistant = assistant_model or settings_dict(generation_config).get("assistant_model")
    if assistant is not None:
        for t in traces:
            t.speculative = assisted(assistant, generation_config, model)
    return traces


def assisted(assistant: Any, generation_config: Any, model: Any) -> dict[str, Any]:
    """The `speculative` field of an assisted generation's trace: what is known of the draft, and
    that its proposals are not in transformers' output (the steps' numbers are the target's)."""
    given = settings_dict(generation_config)
    own = getattr(getattr(model, "generation_config", None), "num_assistant_tokens", None)
    config = getattr(assistant, "config", None)
    return {
        "draft": "assistant_model",
        "draft_tokens": given.get("num_assistant_tokens", own),
        "acceptance_by_position": None,
        "conditional_acceptance_by_position": None,
        "mean_accepted_per_block": None,
        "blocks": None,
        "target_forwards": None,
        "draft_forwards": None,
        "draft_model": {
            "source": getattr(config, "name_or_path", None) or type(assistant).__name__,
            "layers": getattr(config, "num_hidden_layers", None),
        },  # fmt: skip
        "proposals_recorded": False,
        "note": "model.generate's output holds the target's numbers per token; the assistant's proposals, "
        "its distribution q and the acceptance verdicts are not in it",
    }
