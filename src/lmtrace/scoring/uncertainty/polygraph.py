"""The per-sequence estimators that need one more pass of the model, with LM-Polygraph's
definitions: PMI and conditional PMI (the generated tokens teacher-forced once without the
prompt) and p(True) (one forward of the model's own "Is the possible answer true?" prompt).

    extra = lmtrace.scoring.uncertainty.polygraph.estimate(lm, trace)
    extra["pmi"], extra["cpmi"], extra["p_true"]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmtrace.logits import measure, sequence
from lmtrace.model.lm import LM
from lmtrace.records import Trace
from lmtrace.scoring.teacher.score import score

# LM-Polygraph's PTrue prompt (estimators/p_true.py, after Kadavath et al. 2022), scored on the
# continuation " True"
P_TRUE_PROMPT = "Question: {question}\nPossible answer: {answer}\nIs the possible answer:\n (A) True\n (B) False\nThe possible answer is:"  # noqa: E501
P_TRUE_CONTINUATION = " True"


def unconditioned(lm: LM, token_ids: list[int]) -> list[float | None]:
    """log p(y_t | y_<t) of the generated tokens without the prompt, one teacher-forced pass;
    None for the first token (nothing to condition on)."""
    if len(token_ids) < 2:
        return [None] * len(token_ids)
    ids = torch.tensor([token_ids], device=lm.model.device)  # (1, T)
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[0].float()  # (T, vocab)
    forced = measure.targets(logits[:-1], ids[0, 1:], 0)
    return [None, *forced.logprob]


def pmi(lm: LM, trace: Trace, tau: float = sequence.CPMI_TAU, lambd: float = sequence.CPMI_LAMBDA) -> dict[str, Any]:
    """{pmi, cpmi, pmi_terms, cpmi_terms, unconditioned}: LM-Polygraph's
    MeanPointwiseMutualInformation and MeanConditionalPointwiseMutualInformation (higher: more
    uncertain), with their token terms."""
    lps = [s.logprob for s in trace.steps]
    ents = [s.entropy for s in trace.steps]
    lm_lps = unconditioned(lm, list(trace.token_ids))
    filled = [0.0 if u is None else u for u in lm_lps]  # the first token's term uses no unconditioned value
    p_terms = sequence.pmi_terms(lps, filled)
    c_terms = sequence.cpmi_terms(lps, filled, ents, tau, lambd)
    return {
        "pmi": sequence.negated_mean(p_terms),
        "cpmi": sequence.negated_mean(c_terms),
        "pmi_terms": p_terms,
        "cpmi_terms": c_terms,
        "unconditioned": lm_lps,
        "cpmi_tau": tau,
        "cpmi_lambda": lambd,
    }


def p_true(lm: LM, question: str, answer: str) -> dict[str, Any]:
    """{p_true, PTrue, prompt}: the log-probability of " True" after LM-Polygraph's prompt (one
    forward), and PTrue = -that (higher: more uncertain)."""
    prompt = P_TRUE_PROMPT.format(question=question.strip(), answer=answer.strip())
    found = score(lm, prompt=prompt, continuation=P_TRUE_CONTINUATION, top_logprobs=0)
    lp = found.total_logprob  # type: ignore[union-attr]
    return {"p_true": lp, "PTrue": -lp, "prob": math.exp(lp), "prompt": prompt}


def estimate(lm: LM, trace: Trace, question: str | None = None) -> dict[str, Any]:
    """PMI, conditional PMI and p(True) of a generation (the question: its prompt's text)."""
    return {**pmi(lm, trace), "p_true": p_true(lm, question or trace.prompt["text"], trace.text)}
