"""Rescores another engine's tokens teacher-forced with the model and reports, per token, the
engine's logprob, the model's raw and processed logprobs, the difference, the KL divergence over
the engine's reported alternatives (both renormalised to that set), and top-1 agreement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace.comparison.parse import Reported, Token, token_bytes
from lmtrace.comparison.verdict import fit_temperature, judge
from lmtrace.detokenize import TokenBytes
from lmtrace.logits import sampling
from lmtrace.model.lm import LM, require_chat_template
from lmtrace.params import SamplingParams


@dataclass
class Comparison:
    kind: str
    tokens: list[dict[str, Any]] = field(default_factory=list)
    unmapped: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "summary": self.summary, "unmapped": self.unmapped, "tokens": self.tokens}


class Vocabulary:
    """Token bytes -> id for the model's tokenizer (special tokens only when nothing else matches)."""

    def __init__(self, tokenizer: Any):
        tb = TokenBytes(tokenizer)
        self.by_bytes: dict[bytes, int] = {}
        for token_id in sorted(range(len(tokenizer)), key=lambda i: (i in tb.special, i)):
            self.by_bytes.setdefault(tb(token_id), token_id)

    def id_of(self, token: Token) -> int | None:
        return self.by_bytes.get(token_bytes(token.text, token.bytes))


def prompt_ids(lm: LM, rep: Reported) -> list[int]:
    if rep.prompt_ids is not None:
        return list(rep.prompt_ids)
    tok = lm.tokenizer
    if rep.messages is not None:
        require_chat_template(lm, "messages", "give a prompt instead")
        text = tok.apply_chat_template(rep.messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    if rep.prompt is not None:
        return list(tok(rep.prompt)["input_ids"])
    return []


def _kl(engine: list[tuple[int, float]], model_lp: torch.Tensor) -> float | None:
    """KL(engine || model) over the engine's reported alternatives, both renormalised to that set."""
    pairs = [(i, lp) for i, lp in engine if lp is not None and math.isfinite(lp)]
    if len(pairs) < 2:
        return None
    p = torch.softmax(torch.tensor([lp for _, lp in pairs], dtype=torch.float64), 0)
    q = torch.softmax(model_lp[[i for i, _ in pairs]].double(), 0)
    return float((p * (p / q).log()).sum())


def _record(i: int, tok: Token, token_id: int, raw: torch.Tensor, used: torch.Tensor, vocab: Vocabulary) -> dict:
    alts = [(vocab.id_of(a), a.logprob) for a in tok.top]
    alts = [(a, lp) for a, lp in alts if a is not None]
    model_lp = float(raw[token_id])
    return {
        "index": i,
        "token": tok.text,
        "token_id": token_id,
        "engine_logprob": tok.logprob,
        "model_logprob": model_lp,
        "model_processed_logprob": float(used[token_id]),
        "diff": None if tok.logprob is None else tok.logprob - model_lp,
        "kl_top": _kl(alts, raw),
        "engine_top1": int(raw.argmax()) == token_id,
        "model_rank": int((raw > raw[token_id]).sum()) + 1,
    }


def compare(
    lm: LM,
    response: Reported | dict,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    threshold: float = 0.1,
) -> Comparison:
    """Compares a response (parsed, or a dict in any shape parse_response reads) with the model."""
    from lmtrace.comparison.parse import parse_response

    rep = response if isinstance(response, Reported) else parse_response(response)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    vocab = Vocabulary(lm.tokenizer)
    ids, tokens = prompt_ids(lm, rep), list(rep.tokens)
    result = Comparison(rep.kind)
    mapped: list[int] = []
    for i, tok in enumerate(tokens):
        token_id = tok.id if rep.kind == "lmtrace" else vocab.id_of(tok)
        if token_id is None:  # not guessed: the comparison stops where the sequence is unknown
            result.unmapped.append({"index": i, "token": tok.text, "bytes": list(token_bytes(tok.text, tok.bytes))})
            break
        mapped.append(token_id)
    seq = ids + mapped
    if len(seq) < 2:
        result.summary = judge([], [], threshold, None)
        return result
    with torch.inference_mode():
        logits = lm.model(torch.tensor([seq], device=lm.model.device), use_cache=False).logits[0].float()
    start = max(len(ids), 1)  # the first token of a sequence has nothing to condition on
    rows = logits[start - 1 : len(seq) - 1]  # (scored, vocab)
    raw = torch.log_softmax(rows, -1)
    used = torch.log_softmax(sampling.process_logits(rows, params, None), -1)
    offset = start - len(ids)
    for j in range(rows.shape[0]):
        i = offset + j
        if tokens[i].logprob is None:
            continue
        result.tokens.append(_record(i, tokens[i], seq[start + j], raw[j], used[j], vocab))
    chosen = torch.tensor([seq[start + j] for j in range(rows.shape[0])])
    engine = [tokens[offset + j].logprob for j in range(rows.shape[0])]
    fit = fit_temperature(rows, chosen, engine)
    processed = params.temperature != 1.0 or params.top_k or params.top_p < 1.0
    result.summary = judge(result.tokens, engine, threshold, fit, processed=bool(processed))
    result.summary["unmapped"] = len(result.unmapped)
    return result
