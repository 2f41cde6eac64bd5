"""A row of a continuous batch that decodes speculatively (`RowSpec.draft`): its draft proposes
K tokens and the target verifies them in one forward (decode/speculative.py `Speculation`), one
block per batch step, while the other rows step together. The row keeps its own target and draft
caches, so its steps are exactly those of the same request decoded alone with the draft (token
ids, numbers, `draft` verdicts, the trace's `speculative`, a stop string ending its block); its
records, finish and `on_step` are the batch's own (decode/row_state.py `record`). Every call runs
under torch.inference_mode of its own: nothing is left suspended inside a context between steps.

The row's lens, attention and attribution are its own forwards' (the prefill, each block's verify
forward), as `lmtrace.generate` with the draft records them: their hooks are on the model only
while the row's own prefill or block runs, never during the batch's forward (whose rows capture
theirs through decode/row_inside.py)."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.decode import engine, speculative
from lmtrace.decode.observers import Echo, Inside, Observer, attached
from lmtrace.decode.row_state import RowState, record
from lmtrace.detokenize import TokenBytes
from lmtrace.errors import GenerationError
from lmtrace.inside.probe import Probe
from lmtrace.logits import forced
from lmtrace.model.lm import LM


class DraftedRow:
    """A row with its draft: prefilled on joining; `block()` decodes and records its next block."""

    def __init__(self, lm: LM, row: RowState):
        spec, p = row.spec, row.params
        self.lm, self.row = lm, row
        self.tally = speculative.Tally(spec.draft.spec, spec.draft_tokens, spec.draft.describe())
        eos = sorted(lm.eos_token_ids) if p.stop_on_eos else []
        grammars = [row.grammar] if row.grammar is not None else None

        def fed(_: int, token: int) -> bool:  # the row's record sees each token as the loop judges it
            return row.add(token, token in eos)

        self.observers = own_observers(spec, p.top_logprobs)
        setup = engine.Setup(eos, lm.pad_token_id, fed, False, self.observers, grammars, tuple(spec.logits_processors))
        drafting = speculative.Drafting(spec.draft.model, spec.draft_tokens, self.tally)
        self.run = speculative.Speculation(lm.model, spec.ids, p, row.generator, setup, drafting)
        with torch.inference_mode(), attached(self.observers, lm.model):
            self.run.prefill()

    def block(self, tb: TokenBytes) -> bool:
        """The row's next block of steps (up to the first rejected proposal and the target's own
        token); True when the row leaves the batch (its trace or its `error` set)."""
        try:
            with torch.inference_mode(), attached(self.observers, self.lm.model):
                for bs in self.run.block():
                    if self._record(bs, tb):
                        return True
        except Exception as e:  # its grammar allowed nothing, a failed forward: this row alone
            self.row.error = e
            return True
        if self.run.done:  # the loop ended without a finishing step: not a lone run's steps
            self.row.error = GenerationError("the drafted row's decoding ended without a finish reason")
        return self.run.done

    def _record(self, bs: Any, tb: TokenBytes) -> bool:
        kv = bs.kv.to_dict()
        if bs.crop is not None:  # the caches cut back after a rejection
            kv["crop"] = bs.crop
        self.row.step_ms = 0.0
        if bs.entries.get("prompt") is not None:  # echo: the prompt's numbers, from the row's prefill
            numbers = bs.entries.pop("prompt")[0]
            self.row.prompt_logprobs = forced.token_scores(self.lm.tokenizer, self.row.spec.ids, 0, numbers, tb)
        left = record(self.lm, self.row, bs, 0, kv, bs.time_ms, tb, hit=bs.finish[0] == "stop")
        if left and self.row.trace is not None:
            self.row.trace.speculative = self.tally.to_dict()
        return left


def own_observers(spec: Any, top_logprobs: int) -> list[Observer]:
    """The drafted row's observers: echo, its lens and attention (a probe of its own prompt), the
    request's own (the attribution among them)."""
    out: list[Observer] = [*([Echo(top_logprobs)] if spec.echo else []), *spec.observers]
    lens, attention = getattr(spec, "lens", False), getattr(spec, "attention", False)
    if lens or attention:  # after the attribution, as generate orders them (decode/options.py)
        out.append(Inside(Probe([spec.ids], top_logprobs, lens, attention)))
    return out


def drafted(spec: Any) -> bool:
    return getattr(spec, "draft", None) is not None
