"""The sampling waterfall: the distribution after each stage of the processors, in the
documented order raw -> [grammar] -> [the user's processors] -> [logit bias] -> repetition penalty
-> temperature -> top-k -> top-p -> min-p. The grammar stage (a constrained step:
lmtrace.logits.grammar's mask) is listed only where a grammar constrained the step, the logit
bias only where the params have one, a user's processor under its own name.

The stages are a scan of the one list processing folds (lmtrace.logits.processors), so the
last stage is exactly the distribution the token was chosen from (its `sampled_logprob`).
Greedy decoding applies only the logit bias and the penalty: the later stages are listed as not
applied."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmtrace.logits import grammar, measure, processors
from lmtrace.params import SamplingParams

DEFAULT_TOKENS = 5  # raw top tokens followed through the stages when top_logprobs is 0


def _stage_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None,
    allowed: torch.Tensor | None,
    user: Sequence[processors.UserProcessor] = (),
    history: Sequence[Sequence[int]] | None = None,
) -> list[tuple]:
    """[(stage, setting, applied, logits (batch, vocab))]: raw, the grammar (where a grammar
    constrained the step), then the processors' own scan (the user's first, under their names)."""
    out = [("raw", None, True, logits)]
    if allowed is not None:
        out.append(("grammar", params.constraint, True, grammar.mask(logits, allowed)))
    return out + processors.scan(out[-1][3], params, seen, processors.ORDER, user, history)


def stages(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None,
    chosen: torch.Tensor,
    top_n: int,
    allowed: torch.Tensor | None = None,
    user: Sequence[processors.UserProcessor] = (),
    history: Sequence[Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """One waterfall per row of `logits` (batch, vocab) for the chosen tokens (batch,):
    {"token_ids": raw top tokens, "stages": [{stage, setting, applied, allowed, removed_mass,
    entropy, chosen_prob, chosen_rank, probs}]}; with_texts gives the recorded form.
    `removed_mass` is the probability, under the distribution entering the stage, of the tokens
    the stage removed; `probs` are those of the `token_ids` after the stage (0 where removed).
    `allowed` (batch, vocab) bool: the grammar's mask, a stage of its own after raw."""
    n = top_n or DEFAULT_TOKENS
    follow = torch.topk(logits, n, dim=-1).indices  # (batch, n)
    rows: list[dict[str, Any]] = [{"token_ids": follow[r].tolist(), "stages": []} for r in range(logits.shape[0])]
    previous = None
    for name, setting, applied, stage_logits in _stage_logits(logits.float(), params, seen, allowed, user, history):
        logp = torch.log_softmax(stage_logits, dim=-1)  # (batch, vocab)
        probs = logp.exp()
        allowed = torch.isfinite(stage_logits)
        chosen_lp = logp.gather(-1, chosen[:, None])  # (batch, 1)
        numbers = {
            "allowed": allowed.sum(-1).tolist(),
            "removed_mass": (
                [0.0] * logits.shape[0]
                if previous is None
                else (previous[1] * (previous[0] & ~allowed)).sum(-1).tolist()
            ),
            "entropy": measure.entropy(logp).tolist(),
            "chosen_prob": chosen_lp.exp()[:, 0].tolist(),
            "chosen_rank": measure.rank(logp, chosen_lp).tolist(),
            "probs": probs.gather(-1, follow).tolist(),
        }
        for r, row in enumerate(rows):
            stage = {"stage": name, "setting": setting, "applied": applied}
            stage.update({k: v[r] for k, v in numbers.items()})
            if not torch.isfinite(chosen_lp[r, 0]):
                stage["chosen_rank"] = None  # a forced token the stage removed has no rank
            row["stages"].append(stage)
        previous = (allowed, probs)
    return rows


def with_texts(waterfall: dict[str, Any], text_of: Callable[[int], str]) -> list[dict[str, Any]]:
    """The recorded form, a list of stages: each stage's `probs` become `tokens`, [{token_id,
    text, prob}] in the raw model's order, so every stage reads on its own (the engine knows
    ids only; `text_of` gives a token's text)."""
    ids = waterfall["token_ids"]
    texts = [text_of(t) for t in ids]
    out = []
    for stage in waterfall["stages"]:
        tokens = [{"token_id": t, "text": x, "prob": p} for t, x, p in zip(ids, texts, stage["probs"])]
        out.append({**{k: v for k, v in stage.items() if k != "probs"}, "tokens": tokens})
    return out
