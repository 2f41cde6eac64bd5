"""Quantization over a corpus: model A (the reference) and model B (another file, the same GGUF's
packed weights, another dtype) side by side over one text, with the statistics
`llama-perplexity --kl-divergence` prints, computed without its base-logits file.

llama.cpp's rules, followed here: the text is tokenized once (a BOS first where the tokenizer
adds one) and cut into chunks of `ctx` tokens (the rest dropped); each chunk is one forward pass
from an empty cache, its first token replaced by the BOS where the tokenizer adds one; only the
second half of each chunk is scored (logits at positions ctx/2 .. ctx-2, each predicting the
next token), so every scored token sees at least ctx/2 tokens of context. Per position: KL(A‖B)
= Σ p_A (log p_A − log p_B) over the whole vocabulary (llama.cpp leaves out base log-probs
below −16, an artefact of its 16-bit file), Δp = p_B − p_A of the text's next token, and whether
both argmaxes agree. Percentiles interpolate linearly at fraction × (n − 1) of the sorted
values; the median is the middle value (the mean of the two middle ones)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.model.lm import LM

DELTA_P = {
    "p1": 0.01,
    "p5": 0.05,
    "p10": 0.10,
    "p25": 0.25,
    "median": 0.5,
    "p75": 0.75,
    "p90": 0.90,
    "p95": 0.95,
    "p99": 0.99,
}


def percentile(values: Sequence[float], fraction: float) -> float:
    """llama.cpp's percentile of sorted `values`: linear interpolation at fraction × (n − 1)."""
    if fraction <= 0:
        return values[0]
    if fraction >= 1:
        return values[-1]
    p = fraction * (len(values) - 1)
    i = int(p)
    p -= i
    return (1 - p) * values[i] + p * values[min(i + 1, len(values) - 1)]


def median(values: Sequence[float]) -> float:
    n = len(values)
    return 0.5 * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2]


def text_ids(lm: LM, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama.cpp takes them (a BOS first where the tokenizer adds one), and
    that BOS id (None where it adds none)."""
    tok = lm.tokenizer
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    bos = tok.bos_token_id
    adds = bos is not None and list(tok("a")["input_ids"])[:1] == [bos]
    return ([bos] + ids if adds else ids), (bos if adds else None)


def chunks_of(ids: list[int], ctx: int, bos: int | None, limit: int | None) -> list[list[int]]:
    """Chunks of `ctx` tokens, the first of each replaced by the BOS where there is one."""
    n = len(ids) // ctx if limit is None else min(limit, len(ids) // ctx)
    out = []
    for i in range(n):
        chunk = ids[i * ctx : (i + 1) * ctx]
        out.append([bos, *chunk[1:]] if bos is not None else chunk)
    return out


def chunk_logits(lm: LM, chunk: list[int]) -> torch.Tensor:
    """Raw logits of one chunk from an empty cache: (ctx, vocab) float32."""
    model = lm.model
    with torch.inference_mode():
        out = model(torch.tensor([chunk], device=model.device), use_cache=False)
    return out.logits[0].float().cpu()


def positions(la: torch.Tensor, lb: torch.Tensor, chunk: list[int]) -> dict[str, torch.Tensor]:
    """The scored half of one chunk: logits (ctx, vocab) of A and B -> per position (ctx − 1 −
    ctx/2 of them) the KL, the next token's log-probs under each, both argmaxes."""
    ctx = len(chunk)
    first = ctx // 2
    target = torch.tensor(chunk[first + 1 :])  # (n,)
    lpa = torch.log_softmax(la[first : ctx - 1].double(), dim=-1)  # (n, vocab) float64
    lpb = torch.log_softmax(lb[first : ctx - 1].double(), dim=-1)
    kl = (lpa.exp() * (lpa - lpb)).sum(-1)  # (n,)
    rows = torch.arange(len(target))
    return {
        "kl": kl,
        "lpa": lpa[rows, target],
        "lpb": lpb[rows, target],
        "top_a": la[first : ctx - 1].argmax(-1),
        "top_b": lb[first : ctx - 1].argmax(-1),
        "pa_top": lpa.max(-1).values.exp(),
        "pb_top": lpb.max(-1).values.exp(),
    }


def statistics(kl: list[float], lpa: list[float], lpb: list[float], same: int) -> dict[str, Any]:
    """The numbers llama-perplexity --kl-divergence prints, from the per-position values."""
    n = len(kl)
    nll_a, nll_b = -sum(lpa) / n, -sum(lpb) / n
    dp = sorted(math.exp(b) - math.exp(a) for a, b in zip(lpa, lpb))
    ks = sorted(kl)
    return {
        "tokens": n,
        "ppl_a": math.exp(nll_a),
        "ppl_b": math.exp(nll_b),
        "ppl_ratio": math.exp(nll_b - nll_a),
        "ln_ppl_ratio": nll_b - nll_a,
        "kld": {
            "mean": sum(kl) / n,
            "median": median(ks),
            "p99": percentile(ks, 0.99),
            "p99_9": percentile(ks, 0.999),
            "max": ks[-1],
            "min": ks[0],
        },
        "delta_p": {
            "mean": sum(dp) / n,
            "rms": math.sqrt(sum(d * d for d in dp) / n),
            **{k: (median(dp) if k == "median" else percentile(dp, f)) for k, f in DELTA_P.items()},
            "min": dp[0],
            "max": dp[-1],
        },
        "same_top": same / n,
    }


def kld(
    lm: LM,
    against: LM | str,
    text: str,
    ctx: int = 512,
    chunks: int | None = None,
    worst: int = 10,
    context: int = 24,
    on_chunk: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """A (`lm`) against B (`against`) over `text`: {tokens, ppl_a, ppl_b, ppl_ratio, kld: {mean,
    median, p99, p99_9, max}, delta_p: {p1 ... p99}, same_top, worst: [...]} and how it was cut
    (ctx, chunks). `against`: an LM, or its spec as `against_model` reads it ("packed",
    "dtype:bfloat16", a path). `worst`: the positions of largest KL with `context` tokens before them."""
    if isinstance(against, str):
        against = against_model(lm, against)
    if ctx < 4:
        raise InvalidParameter(f"ctx must be >= 4, got {ctx}")
    if chunks is not None and chunks < 1:
        raise InvalidParameter(f"chunks must be >= 1, got {chunks}")
    if against.tokenizer.get_vocab() != lm.tokenizer.get_vocab():
        raise InvalidParameter(f"against: {against.source}'s tokenizer differs from {lm.source}'s")
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if limit and ctx > limit:
        raise InvalidParameter(f"ctx must be at most the model's {limit} positions, got {ctx}")
    ids, bos = text_ids(lm, text)
    parts = chunks_of(ids, ctx, bos, chunks)
    if not parts:
        raise InvalidParameter(f"file: the text has {len(ids)} tokens, fewer than one chunk of ctx {ctx}")
    found: dict[str, list[Any]] = {}
    for i, chunk in enumerate(parts):
        row = positions(chunk_logits(lm, chunk), chunk_logits(against, chunk), chunk)
        for k, v in row.items():
            found.setdefault(k, []).extend(v.tolist())
        if on_chunk is not None:
            on_chunk(i + 1, len(parts))
    same = sum(a == b for a, b in zip(found["top_a"], found["top_b"]))
    result = statistics(found["kl"], found["lpa"], found["lpb"], same)
    result.update(a=lm.source, b=against.source, ctx=ctx, chunks=len(parts), text_tokens=len(ids))
    result["worst"] = worst_positions(lm, parts, found, worst, context)
    return result


def worst_positions(
    lm: LM, parts: list[list[int]], found: dict[str, list[Any]], n: int, context: int
) -> list[dict[str, Any]]:
    """The `n` positions of largest KL: where in the text, the token, both models' numbers, both
    top tokens and the text just before it."""
    ctx = len(parts[0])
    per_chunk = ctx - 1 - ctx // 2
    order = sorted(range(len(found["kl"])), key=lambda k: -found["kl"][k])[:n]
    tok = lm.tokenizer
    out = []
    for k in order:
        c, j = divmod(k, per_chunk)
        at = ctx // 2 + 1 + j  # the target token's index in its chunk
        chunk = parts[c]
        pa, pb = math.exp(found["lpa"][k]), math.exp(found["lpb"][k])
        out.append(
            {
                "position": c * ctx + at,
                "chunk": c,
                "kld": found["kl"][k],
                "token_id": chunk[at],
                "token": tok.decode([chunk[at]]),
                "p_a": pa,
                "p_b": pb,
                "delta_p": pb - pa,
                "top_a": {
                    "token_id": found["top_a"][k],
                    "text": tok.decode([found["top_a"][k]]),
                    "p": found["pa_top"][k],
                },
                "top_b": {
                    "token_id": found["top_b"][k],
                    "text": tok.decode([found["top_b"][k]]),
                    "p": found["pb_top"][k],
                },
                "context": tok.decode(chunk[max(1 if chunk[0] == tok.bos_token_id else 0, at - context) : at]),
            }
        )
    return out


def against_model(lm: LM, against: str) -> LM:
    """B from its spec: `packed` (the same GGUF's own quantized weights), `dtype:NAME` (A's
    weights cast), or the path of another model file or folder."""
    from lmtrace.model.load import load
    from lmtrace.scoring.variants import spec as variant_spec
    from lmtrace.scoring.variants import worlds as variants

    if against == "packed":
        path = variants.gguf_of(lm)
        if path is None:
            raise InvalidParameter(f"against: packed runs a .gguf file's own quantized weights; {lm.source} is not one")
        source = None if lm.source.startswith("bundled:") else str(path)
        packed = load(source, weights="packed")
        return dataclasses.replace(packed, source=f"{packed.source} [packed: {packed.summary.weights}]")
    spec = against if against.startswith(("dtype:", "model:")) else f"model:{against}"
    try:
        parsed = variant_spec.parse_variant(spec)
    except InvalidParameter as e:
        raise InvalidParameter(f"against: {str(e).removeprefix('variant: ')}") from None
    return variants.build(lm, parsed).lm
