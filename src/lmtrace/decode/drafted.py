"""A row of a continuous batch that decodes speculatively (`RowSpec.draft`): its draft proposes
K tokens and the target verifies them in one forward (decode/speculative.py), one block per batch
step, while the other rows step together. The row keeps its own target and draft caches, so its
steps are exactly those of the same request decoded alone with the draft (token ids, numbers,
`draft` verdicts, the trace's `speculative`); its records, stop strings, finish and `on_step` are
the batch's own (decode/rows.py `record`)."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.decode import engine, speculative
from lmtrace.decode.rows import Row, record
from lmtrace.detokenize import TokenBytes
from lmtrace.model.lm import LM


class DraftedRow:
    """A row with its draft: `block()` decodes its next block and records its steps."""

    def __init__(self, lm: LM, row: Row):
        spec = row.spec
        self.lm, self.row = lm, row
        self.tally = speculative.Tally(spec.draft.spec, spec.draft_tokens, spec.draft.describe())
        eos = sorted(lm.eos_token_ids) if row.params.stop_on_eos else []
        grammars = [row.grammar] if row.grammar is not None else None
        setup = engine.Setup(eos, lm.pad_token_id, None, False, list(spec.observers), grammars)
        self.steps = speculative.generate_steps(lm.model, spec.draft.model, spec.ids, row.params, row.generator,
                                                setup, spec.draft_tokens, self.tally)  # fmt: skip

    def block(self, tb: TokenBytes) -> bool:
        """The row's next block of steps (up to the first rejected proposal and its bonus);
        True when the row leaves the batch (its trace or its `error` set)."""
        blocks = len(self.tally.blocks)
        while True:
            try:
                with torch.inference_mode():  # each resumption under the same mode (the loop's own is nested)
                    bs = next(self.steps)
            except StopIteration:
                return True
            except Exception as e:  # its grammar allowed nothing, a failed forward: this row alone
                self.row.error = e
                return True
            kv = bs.kv.to_dict()
            if bs.crop is not None:  # the caches cut back after a rejection
                kv["crop"] = bs.crop
            self.row.step_ms = 0.0
            if record(self.lm, self.row, bs, 0, kv, bs.time_ms, tb):
                self.close()
                return True
            if len(self.tally.blocks) > blocks:
                return False

    def close(self) -> None:
        """Ends the block loop; a finished row's trace gets its speculative summary."""
        self.steps.close()
        if self.row.trace is not None:
            self.row.trace.speculative = self.tally.to_dict()


def drafted(spec: Any) -> bool:
    return getattr(spec, "draft", None) is not None
