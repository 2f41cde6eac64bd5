"""How the rows choose (decode/step.py `Choosing`), built here and nowhere else: every loop (the
static batch, the compiled step, continuous batching, speculative blocks and their draft,
branches, kv-lab's arms) describes its rows' state as `Rows` and gets its Choosing from
`choosing`; a draft's proposals choose under `forked`, a copy that the proposals move without
moving the row. What is made from the rows' tokens is made here once: the repetition penalty's
seen tokens (the prompt and the tokens generated so far) and the history the user's processors
are handed (the generated tokens, kept only where the user gave processors).

    how = choosing(Rows([params], rng, prompts=prompt_ids, made=[[]] * len(prompt_ids)), model)
    own = forked(how)                    # a draft's: its seen, grammar and history its own
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.decode.step import Choosing
from lmtrace.logits import grammar, processors, sampling
from lmtrace.params import SamplingParams


@dataclass
class Rows:
    """The rows' state a Choosing is made from. `params`: one SamplingParams for every row (the
    batch processed as one tensor) or one per row; `rng`: one generator or one per row (None:
    greedy); `prompts`: each row's tokens before the generated ones, from which (with `made`)
    the penalty's seen tokens are made, or None to take `seen` as it is (a fork's saved mask,
    continuous rows' own masks); `made`: each row's generated tokens so far (None: none kept);
    `grammars`: each row's matcher (None: unconstrained); `user`: the user's processors of every
    row, or `own_user` one list per row (continuous batching: rows of different requests)."""

    params: Sequence[SamplingParams]
    rng: sampling.Rng = None
    prompts: Sequence[Sequence[int]] | None = None
    made: Sequence[Sequence[int]] | None = None
    seen: torch.Tensor | Sequence[torch.Tensor | None] | None = None
    grammars: Sequence[grammar.Matcher | None] | None = None
    user: Sequence[processors.UserProcessor] = ()
    own_user: Sequence[Sequence[processors.UserProcessor]] | None = None


def choosing(rows: Rows, model: Any = None) -> Choosing:
    """How `rows` choose: the seen tokens made from their prompts and generated tokens on the
    model's vocabulary and device (where `prompts` is given), the history of their generated
    tokens where the user gave processors."""
    seen = rows.seen
    if rows.prompts is not None:
        made = rows.made or [[] for _ in rows.prompts]
        sequences = [[*p, *m] for p, m in zip(rows.prompts, made)]
        seen = processors.seen_mask(rows.params[0], sequences, model.config.vocab_size, model.device)
    history = None
    if rows.user or rows.own_user is not None:
        history = [list(m) for m in rows.made] if rows.made is not None else None
    return Choosing(
        list(rows.params),
        rows.rng,
        seen,
        grammars=rows.grammars,
        user=rows.user,
        history=history,
        own_user=rows.own_user,
    )


def forked(how: Choosing) -> Choosing:
    """A copy of `how` for one row's draft: the same params, generator and processors; its own seen
    tokens, grammar (a fork of the row's matcher) and history, which its proposals move without
    moving the row's."""
    seen = how.seen
    if isinstance(seen, torch.Tensor):
        seen = seen.clone()
    elif seen is not None:
        seen = [None if s is None else s.clone() for s in seen]
    grammars = None if how.grammars is None else [None if g is None else g.fork() for g in how.grammars]
    return choosing(Rows(how.params, how.rng, None, how.history, seen, grammars, how.user, how.own_user))
