"""Two hand-written greedy loops side by side, watched: the right one feeds only the new
token; the common mistake feeds the whole sequence again together with the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmtrace.external.watch import Watch, watch
from lmtrace.kv import ledger
from lmtrace.model.lm import LM


@dataclass
class LoopRun:
    tokens: list[int]
    logits: list[torch.Tensor]  # (vocab,) per round
    watch: Watch


def run_loop(lm: LM, prompt_ids: list[int], rounds: int, refeed: bool) -> LoopRun:
    """A person's own greedy loop; `refeed=True` is the mistake of passing the whole sequence."""
    model = lm.model
    seq = torch.tensor([prompt_ids], device=model.device)
    cache = ledger.new_cache(model)
    step_input, tokens, logits = seq, [], []
    with watch(model) as w, torch.inference_mode():
        for _ in range(rounds):
            out = model(input_ids=step_input, **ledger.cache_kwargs(model, cache))
            last = out.logits[0, -1].float()
            token = int(last.argmax())
            tokens.append(token)
            logits.append(last)
            seq = torch.cat([seq, seq.new_tensor([[token]])], dim=1)
            step_input = seq if refeed else seq[:, -1:]
    return LoopRun(tokens, logits, w)


def compare(lm: LM, prompt_ids: list[int], rounds: int = 6) -> dict:
    """Cache lengths per round of both loops and how far the mistaken loop's logits drift."""
    import warnings

    good = run_loop(lm, prompt_ids, rounds, refeed=False)
    with warnings.catch_warnings():  # the problems are reported in the result instead
        warnings.simplefilter("ignore")
        bad = run_loop(lm, prompt_ids, rounds, refeed=True)
    rows = []
    for i, (g, b) in enumerate(zip(good.watch.rounds, bad.watch.rounds)):
        rows.append({
            "round": i,
            "correct_input_len": g.input_len,
            "correct_cache_len": g.cache_len_after,
            "refeed_input_len": b.input_len,
            "refeed_cache_len": b.cache_len_after,
            "max_logit_diff": float((good.logits[i] - bad.logits[i]).abs().max()),
            "same_token": good.tokens[i] == bad.tokens[i],
        })  # fmt: skip
    return {
        "prompt_len": len(prompt_ids),
        "rounds": rows,
        "correct_problems": [p.message for p in good.watch.problems],
        "refeed_problems": [p.message for p in bad.watch.problems],
    }
