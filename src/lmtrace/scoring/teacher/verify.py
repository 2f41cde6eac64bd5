"""`lmtrace verify`: decode greedily with the KV cache, then compare every step with a full
recompute without cache (one teacher-forced forward pass over the whole sequence: causal
attention makes its logits at position p those of a recompute of the prefix) and with
transformers' `model.generate`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lmtrace.decode import engine
from lmtrace.kv import ledger
from lmtrace.model.lm import LM


@dataclass
class StepCheck:
    index: int
    token_id: int
    max_logit_diff: float  # cached vs uncached logits, over the vocabulary
    max_logprob_diff: float  # cached vs uncached log-probabilities
    top1_agrees: bool  # uncached argmax == the cached choice
    margin: float  # cached top-1 minus top-2 logit
    generate_token_id: int | None = None
    generate_logprob_diff: float | None = None


@dataclass
class VerifyReport:
    tolerance: float
    steps: list[StepCheck] = field(default_factory=list)
    first_divergence: dict[str, Any] | None = None
    dtype: str = "float32"
    # for a model in another dtype or with packed weights: the largest log-probability
    # difference over the vocabulary of every step against float32 weights (teacher-forced),
    # the mean |difference| of the chosen tokens' logprobs, and the fraction of steps where the
    # float32 path's top-1 is the chosen token
    float32_max_logprob_diff: float | None = None
    float32_mean_logprob_diff: float | None = None
    float32_top1_agreement: float | None = None
    weights: str = "float"  # "packed": a GGUF's own 4-bit weights (lmtrace.model.gguf.packed)
    # with packed weights, what ran packed: "packed (Q4_K x27, Q5_0 x81, …), float32 activations"
    packed: str | None = None

    @property
    def max_logprob_diff(self) -> float:
        diffs = [s.max_logprob_diff for s in self.steps]
        diffs += [s.generate_logprob_diff for s in self.steps if s.generate_logprob_diff is not None]
        return max(diffs, default=0.0)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None and self.max_logprob_diff <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tolerance": self.tolerance,
            "max_logprob_diff": self.max_logprob_diff,
            "max_logit_diff": max((s.max_logit_diff for s in self.steps), default=0.0),
            "first_divergence": self.first_divergence,
            "dtype": self.dtype,
            "float32_max_logprob_diff": self.float32_max_logprob_diff,
            "float32_mean_logprob_diff": self.float32_mean_logprob_diff,
            "float32_top1_agreement": self.float32_top1_agreement,
            "weights": self.weights,
            "packed": self.packed,
            "steps": [asdict(s) for s in self.steps],
        }


def cached_greedy(lm: LM, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding through the same prefill/decode_step the tracer uses; (ids, logits (steps, vocab))."""
    model = lm.model
    cache = ledger.new_cache(model)
    ids = torch.tensor([prompt_ids], device=model.device)
    out, logits = [], []
    with torch.inference_mode():
        step_logits = engine.prefill(model, ids, None, cache)
        for i in range(max_new_tokens):
            token = int(step_logits.argmax(-1))
            out.append(token)
            logits.append(step_logits[0])
            if token in lm.eos_token_ids or i == max_new_tokens - 1:
                break
            pos = torch.tensor([[len(prompt_ids) + i]], device=model.device)
            step_logits = engine.decode_step(model, torch.tensor([token], device=model.device), pos, None, cache)
    return out, torch.stack(logits)


def uncached_logits(lm: LM, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """(steps, vocab) logits of a full forward pass without cache."""
    seq = torch.tensor([prompt_ids + generated], device=lm.model.device)
    with torch.inference_mode():
        logits = lm.model(seq, use_cache=False).logits[0].float()
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)]


def generate_oracle(lm: LM, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt_ids], device=lm.model.device)
    out = lm.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=lm.eos_token_ids,
        pad_token_id=lm.pad_token_id,
        top_k=None,
        top_p=None,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat([x.float() for x in out.logits])


def default_tolerance(dtype: str, packed: bool = False) -> float:
    """1e-4 in log-probability for float32; half precision rounds far more coarsely. Packed
    weights round each matmul's input to bfloat16, and the lm_head's logits outside its 64
    refined ones keep the kernel's bfloat16 output (0.125 apart at a logit of 20, 0.25 past
    32), so a float32-sized difference between the cached and uncached paths can flip one by a
    spacing (0.26 measured on the bundled model): 0.5."""
    if packed and dtype == "float32":
        return 0.5
    return 1e-4 if dtype == "float32" else 0.1


def float32_cost(reference, prompt_ids: list[int], tokens: list[int], lp: torch.Tensor) -> dict[str, float]:
    """The cost of a cheaper path against float32 `reference` weights, teacher-forced on the
    same sequence: largest |Δ log-probability| over the vocabulary of every step, mean |Δ| of
    the chosen tokens' logprobs, and top-1 agreement. `lp` (steps, vocab) are the path's own."""
    seq = torch.tensor([prompt_ids + tokens], device=reference.device)
    with torch.inference_mode():
        full = reference(seq, use_cache=False).logits[0].float()
    ref = torch.log_softmax(full[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)], -1)  # (steps, vocab)
    chosen = torch.tensor(tokens, device=ref.device)[:, None]
    return {
        "max": float((ref - lp).abs().max()),
        "mean": float((ref.gather(-1, chosen) - lp.gather(-1, chosen)).abs().mean()),
        "top1": float((ref.argmax(-1) == chosen[:, 0]).float().mean()),
    }


def against_float32(lm: LM, prompt_ids: list[int], tokens: list[int], lp: torch.Tensor) -> dict[str, float]:
    """float32_cost against a float32 copy of the model (packed layers dequantized)."""
    from lmtrace.model.gguf.packed import float_reference

    reference = float_reference(lm.model)
    try:
        return float32_cost(reference, prompt_ids, tokens, lp)
    finally:
        del reference


def verify(lm: LM, prompt_ids: list[int], max_new_tokens: int = 32, tolerance: float | None = None) -> VerifyReport:
    from lmtrace.model.gguf.packed import report_of

    dtype = str(next(lm.model.parameters()).dtype).replace("torch.", "")
    pack = report_of(lm.model)
    packed = pack is not None
    tolerance = default_tolerance(dtype, packed) if tolerance is None else tolerance
    tokens, cached = cached_greedy(lm, prompt_ids, max_new_tokens)
    full = uncached_logits(lm, prompt_ids, tokens)
    hf_ids, hf_logits = generate_oracle(lm, prompt_ids, max_new_tokens)
    lp_cached, lp_full = torch.log_softmax(cached, -1), torch.log_softmax(full, -1)
    lp_hf = torch.log_softmax(hf_logits, -1)
    report = VerifyReport(
        tolerance=tolerance,
        dtype=dtype,
        weights="packed" if packed else "float",
        packed=pack.short() if packed else None,
    )
    if dtype != "float32" or packed:
        cost = against_float32(lm, prompt_ids, tokens, lp_cached)
        report.float32_max_logprob_diff = cost["max"]
        report.float32_mean_logprob_diff, report.float32_top1_agreement = cost["mean"], cost["top1"]
    for i, token in enumerate(tokens):
        top2 = torch.topk(cached[i], 2).values
        check = StepCheck(
            index=i,
            token_id=token,
            max_logit_diff=float((cached[i] - full[i]).abs().max()),
            max_logprob_diff=float((lp_cached[i] - lp_full[i]).abs().max()),
            top1_agrees=int(full[i].argmax()) == token,
            margin=float(top2[0] - top2[1]),
        )
        if i < len(hf_ids):
            check.generate_token_id = hf_ids[i]
            check.generate_logprob_diff = float((lp_cached[i] - lp_hf[i]).abs().max())
        report.steps.append(check)
        if report.first_divergence is None:
            report.first_divergence = _divergence(check)
    if report.first_divergence is None and len(hf_ids) != len(tokens):
        report.first_divergence = {
            "step": min(len(hf_ids), len(tokens)),
            "reason": "generate stopped elsewhere",
            "generate_length": len(hf_ids),
            "cached_length": len(tokens),
        }
    return report


def _divergence(c: StepCheck) -> dict[str, Any] | None:
    reasons = []
    if not c.top1_agrees:
        reasons.append("the uncached recompute chooses another token")
    if c.generate_token_id is not None and c.generate_token_id != c.token_id:
        reasons.append(f"model.generate chose token {c.generate_token_id}")
    if not reasons:
        return None
    return {
        "step": c.index,
        "reason": "; ".join(reasons),
        "token_id": c.token_id,
        "margin": c.margin,
        "max_logit_diff": c.max_logit_diff,
    }
