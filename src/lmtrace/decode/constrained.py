"""Constraints in the decoding loops: a model's vocabulary as the grammar engine needs it
(xgrammar's TokenizerInfo, built here from the tokenizer and handed down to
lmtrace.logits.grammar, which knows no tokenizer), one grammar matcher per row, and what a
constrained trace adds at its end: `fields` for a JSON schema, `choices` for a choice."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from lmtrace.decode import choices as choice_marginals
from lmtrace.decode import fields as json_fields
from lmtrace.logits import grammar
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.records import Step

# per tokenizer: {(vocab size, end tokens): Compiler}; building a TokenizerInfo reads the whole
# vocabulary (a quarter of a second for 49152 tokens), so it is done once per tokenizer
_COMPILERS: weakref.WeakKeyDictionary[Any, dict[tuple, grammar.Compiler]] = weakref.WeakKeyDictionary()


def compiler(lm: LM, name: str = "json_schema") -> grammar.Compiler:
    """The grammar compiler of `lm`'s vocabulary: the model's vocabulary size (the logits' width)
    and its end tokens (the ones lmtrace's loop stops on) as the grammar's end. `name`: the
    constraint an error about a missing xgrammar names."""
    vocab = int(lm.model.config.vocab_size)
    key = (vocab, tuple(sorted(lm.eos_token_ids)))
    try:
        found = _COMPILERS.setdefault(lm.tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: compiled each time
        found = {}
    if key not in found:
        info = grammar.engine(name).TokenizerInfo.from_huggingface(
            lm.tokenizer, vocab_size=vocab, stop_token_ids=list(key[1]) or None
        )
        found[key] = grammar.Compiler(info)
    return found[key]


def matchers(lm: LM, params: Sequence[SamplingParams]) -> list[grammar.Matcher | None] | None:
    """One matcher per row (None for an unconstrained row); None when no row is constrained."""
    if all(p.constraint is None for p in params):
        return None
    c = compiler(lm, next(p.constraint for p in params if p.constraint))
    return [c.matcher(p) for p in params]


def summaries(
    lm: LM, prompt_ids: list[int], params: SamplingParams, steps: list[Step], text: str
) -> tuple[list[dict] | None, list[dict] | None]:
    """(fields, choices) of a finished row: a JSON schema's values with their confidence, and a
    choice's options with their exact probability (None where the constraint has none)."""
    if params.json_schema is not None:
        return json_fields.fields(text, steps), None
    if params.choice:
        return None, choice_marginals.marginals(lm, prompt_ids, params, compiler(lm))
    return None, None
