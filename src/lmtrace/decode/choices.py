"""Each option of a choice with its exact probability under the constraint.

An option can be written with many token sequences ("yes" as `yes`, `y`+`es`, `ye`+`s`, ...):
its probability is the sum, over every sequence the grammar allows, of the product of each
token's probability under the raw distribution restricted to the allowed tokens, the end token
included. The grammar's tree of prefixes is walked first without the model (xgrammar's matchers);
then every prefix of one depth is teacher-forced in one batched forward over a copy of the
prompt's cache. Since the restricted distributions sum to 1 at every node, the options sum to 1."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from lmtrace.decode import engine
from lmtrace.detokenize import TokenBytes
from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger
from lmtrace.logits import grammar
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams

MAX_PREFIXES = 4096  # token sequences walked at most; each is one row of a forward pass
CHUNK = 64  # rows per forward pass


@dataclass
class Node:
    """A token sequence the grammar allows as the start of an option, and what may follow it."""

    tokens: tuple[int, ...]
    allowed: list[int]  # the tokens the grammar allows next, end tokens included
    ends: set[int]  # the end tokens among them (the sequence is a whole option)


def tree(compiler: grammar.Compiler, params: SamplingParams) -> list[list[Node]]:
    """The prefixes the grammar allows, by depth (depth d: sequences of d tokens)."""
    stops = set(compiler.info.stop_token_ids)
    levels: list[list[Node]] = []
    frontier = [((), compiler.matcher(params))]
    walked = 0
    while frontier:
        level, following = [], []
        for tokens, matcher in frontier:
            allowed = grammar.allowed_tokens([matcher], compiler.vocab_size, [True])[0]  # (vocab,)
            ids = allowed.nonzero().flatten().tolist()
            level.append(Node(tokens, ids, {t for t in ids if t in stops}))
            for t in ids:
                if t not in stops:
                    child = matcher.fork()
                    child.accept(t)
                    following.append((tokens + (t,), child))
        walked += len(level)
        if walked > MAX_PREFIXES:
            raise InvalidParameter(
                f"choice: the options can be written with more than {MAX_PREFIXES} token sequences; "
                f"lmtrace sums over all of them exactly: give shorter options, got {list(params.choice)!r}"
            )
        levels.append(level)
        frontier = following
    return levels


def _forward(model, cache, paths: list[tuple[int, ...]], prompt_len: int) -> torch.Tensor:
    """The raw logits after each path (rows, vocab): the paths (all of one length) fed after a
    copy of the prompt's cache, CHUNK rows at a time."""
    out = []
    depth = len(paths[0])
    for start in range(0, len(paths), CHUNK):
        rows = paths[start : start + CHUNK]
        own = copy.deepcopy(cache)
        ledger.select_rows(own, torch.zeros(len(rows), dtype=torch.long, device=model.device))  # 1 -> rows
        ids = torch.tensor(rows, dtype=torch.long, device=model.device)  # (rows, depth)
        position = torch.arange(prompt_len, prompt_len + depth, device=model.device).expand(len(rows), depth)
        result = model(input_ids=ids, position_ids=position, logits_to_keep=1, **ledger.cache_kwargs(model, own))
        out.append(result.logits[:, -1, :].float())  # (rows, 1, vocab) -> (rows, vocab)
    return torch.cat(out)


def _restricted(logits: torch.Tensor, allowed: list[int]) -> list[float]:
    """Log-probabilities of the `allowed` tokens under `logits` (vocab,) restricted to them."""
    index = torch.tensor(allowed, dtype=torch.long, device=logits.device)
    keep = torch.full_like(logits, grammar.NEG_INF).index_copy(0, index, logits.index_select(0, index))
    return torch.log_softmax(keep, dim=-1).index_select(0, index).tolist()


def _logsumexp(values: list[float]) -> float:
    if not values:
        return float("-inf")
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def marginals(lm: LM, prompt_ids: list[int], params: SamplingParams, compiler: grammar.Compiler) -> list[dict]:
    """[{text, logprob, tokenizations}] for each option of `params.choice`, in order: its exact
    log-probability after the prompt under the constraint, and how many token sequences write it."""
    levels = tree(compiler, params)
    tb = TokenBytes(lm.tokenizer)
    paths: dict[tuple[int, ...], float] = {(): 0.0}
    ends: dict[str, list[float]] = {o: [] for o in params.choice}
    model = lm.model
    with torch.inference_mode():
        cache = ledger.new_cache(model)
        first = engine.prefill(model, torch.tensor([prompt_ids], device=model.device), None, cache)  # (1, vocab)
        for depth, level in enumerate(levels):
            logits = first if depth == 0 else _forward(model, cache, [n.tokens for n in level], len(prompt_ids))
            for node, row in zip(level, logits):
                here = paths[node.tokens]
                for token, lp in zip(node.allowed, _restricted(row, node.allowed)):
                    if token in node.ends:
                        text = b"".join(tb(t) for t in node.tokens).decode("utf-8", errors="replace")
                        ends.setdefault(text, []).append(here + lp)
                    else:
                        paths[node.tokens + (token,)] = here + lp
    return [{"text": o, "logprob": _logsumexp(ends[o]), "tokenizations": len(ends[o])} for o in params.choice]
