"""What `branch` decodes on: a DynamicCache and the eager forward, or with `compile` a static
cache and the compiled forward (decode/static.py's FORWARD, as generate runs it under a grammar
or observers: the forward compiled, the step eager). The branch point needs the step on the host
(its raw distribution, penalty mask, random stream and grammar are kept for the branches), so the
whole compiled step (STEP) is not used; each branch restarts inside the original's cache, which a
static cache is cut back to by moving its fill mark (ledger.crop: the positions past it are
masked as the future, then written over). The numbers are within 5e-5 of the default path's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.decode import engine, static
from lmtrace.decode.options import Plan
from lmtrace.kv import ledger
from lmtrace.model.lm import LM

# engine.decode_step's arguments and result: (model, tokens, positions, mask, cache) -> (batch, vocab)
Forward = Callable[[Any, torch.Tensor, torch.Tensor, Any, Any], torch.Tensor]


@dataclass
class Decoding:
    """The cache a branch session shares and the one-token forward over it."""

    cache: Any
    forward: Forward


def decoding(lm: LM, plan: Plan, prompt_len: int) -> Decoding:
    """The session's cache and forward as `plan` asks; with `compile`, the plan's `kind` (the
    traces' `model.config.compile`) names what runs compiled."""
    if not plan.options.compile:
        return Decoding(ledger.new_cache(lm.model), engine.decode_step)
    plan.kind = static.described(static.FORWARD, lm.model.device)
    length = static.capacity(prompt_len + plan.params.max_new_tokens)  # whole buckets: one graph serves them
    return Decoding(ledger.new_cache(lm.model, length), static.compiled_forward(lm.model))
