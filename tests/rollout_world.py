"""Rollouts made with lmtrace itself (seeded sampling; its logprobs stand for the engine's),
and each planted fault alone, for the rollouts tests."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lmtrace.decode.tracing import generate_ids
from lmtrace.model.lm import LM
from lmtrace.scoring.rollouts.probes import canonical
from lmtrace.scoring.variants import worlds as variants

PROMPTS = ["Hello world, the", "Once upon a time", "The quick brown"]


def decode(lm: LM, prompt_ids: list[list[int]], n: int = 12, seed: int = 0, raw: bool = False,
           **sampling: Any) -> list[dict[str, Any]]:  # fmt: skip
    """One rollout per prompt: the ids lmtrace samples, the engine's logprobs (the sampled
    distribution's, or with raw=True the raw distribution's: an engine that reports raw logprobs)."""
    traces = generate_ids(lm, prompt_ids, max_new_tokens=n, seed=seed, stop_on_eos=False, **sampling)
    out = []
    for k, (ids, t) in enumerate(zip(prompt_ids, traces)):
        lps = [s.logprob if raw else s.sampled_logprob for s in t.steps]
        out.append({"id": f"s{seed}/{k}", "prompt_ids": list(ids), "completion_ids": list(t.token_ids),
                    "logprobs": lps, "sampling": {kk: v for kk, v in sampling.items()}})  # fmt: skip
    return out


def prompt_ids(lm: LM) -> list[list[int]]:
    return [list(lm.tokenizer(p)["input_ids"]) for p in PROMPTS]


def clean(lm: LM, seed: int = 0, **sampling: Any) -> list[dict[str, Any]]:
    return decode(lm, prompt_ids(lm), seed=seed, **sampling)


def off_by_one(lm: LM) -> list[dict[str, Any]]:
    """The ids shifted by one against their logprobs: the prompt's last id counted as the first
    completion id (logprob i belongs to the id at i + 1)."""
    out = []
    for r in clean(lm, seed=1):
        p, c = r["prompt_ids"], r["completion_ids"]
        out.append({**r, "prompt_ids": p[:-1], "completion_ids": [p[-1]] + c[:-1]})
    return out


def retokenized(lm: LM) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(faulty, normal): a second turn after a sampled first turn whose split is not the text's
    own. Faulty: the engine saw the history re-tokenized from its text, the record keeps the
    sampled ids. Normal: the engine continued from the sampled ids themselves."""
    for seed in range(20):
        first = decode(lm, prompt_ids(lm), n=10, seed=seed, temperature=1.0)
        turns = [r["prompt_ids"] + r["completion_ids"] for r in first]
        if all(canonical(lm.tokenizer, t) != t for t in turns):
            break
    else:
        raise AssertionError("no seed gave a sampled split that differs from the text's own")
    engine_saw = decode(lm, [canonical(lm.tokenizer, t) for t in turns], seed=100, temperature=1.0)
    faulty = [{**e, "id": f"retok/{k}", "prompt_ids": t} for k, (e, t) in enumerate(zip(engine_saw, turns))]
    normal = [{**r, "id": f"split/{k}"} for k, r in enumerate(decode(lm, turns, seed=100, temperature=1.0))]
    return faulty, normal


def temperature_raw(lm: LM) -> list[dict[str, Any]]:
    """Sampled at temperature 0.7, the logprobs reported at temperature 1 (the raw ones)."""
    return decode(lm, prompt_ids(lm), seed=2, raw=True, temperature=0.7)


def top_p_unrenormalised(lm: LM) -> list[dict[str, Any]]:
    """Sampled with top-p 0.9, the logprobs reported before the nucleus is renormalised."""
    return decode(lm, prompt_ids(lm), seed=3, raw=True, top_p=0.9)


def other_model(lm: LM, model: Any, seed: int) -> list[dict[str, Any]]:
    other = LM.from_objects(model, lm.tokenizer, source=f"{lm.source} [engine]")
    return decode(other, prompt_ids(lm), seed=seed, temperature=1.0)


def bfloat16(lm: LM) -> list[dict[str, Any]]:
    """The engine ran the model in bfloat16."""
    return other_model(lm, variants.cast(lm.model, torch.bfloat16), seed=4)


def perturbed(lm: LM, scale: float = 0.05) -> list[dict[str, Any]]:
    """The engine's weights are not the trainer's: every weight moved by scale × its own spread."""
    model = copy.deepcopy(lm.model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.float().std() * scale)
    return other_model(lm, model, seed=5)


def _vocab_texts(tokenizer: Any) -> dict[str, int]:
    """Each whole-character token's text -> its id (special tokens left out)."""
    special = set(tokenizer.all_special_ids)
    out: dict[str, int] = {}
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i]) if i not in special else ""
        if text and "\ufffd" not in text:
            out.setdefault(text, i)
    return out


def other_split(tokenizer: Any, ids: list[int]) -> list[int]:
    """`ids` (the text's own encoding) with every pair of neighbours that two other tokens also
    spell split that other way ('ban'+'n' -> 'b'+'ann'): the same text in as many ids, that encode
    back to `ids`. Fails when the text has no such pair."""
    vocab, out, j = _vocab_texts(tokenizer), list(ids), 0
    while j < len(out) - 1:
        a, b = tokenizer.decode([out[j]]), tokenizer.decode([out[j + 1]])
        both = a + b
        cuts = [k for k in range(1, len(both)) if k != len(a) and both[:k] in vocab and both[k:] in vocab]
        if cuts:
            out[j : j + 2] = [vocab[both[: cuts[0]]], vocab[both[cuts[0] :]]]
            j += 1
        j += 1
    assert out != ids and canonical(tokenizer, out) == ids, "no pair of this text's tokens splits another way"
    return out


def teacher_forced(lm: LM, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' own float32 logprob of each completion id (the engine's, at temperature 1)."""
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def completion_reencoded(lm: LM, text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(faulty, normal): the engine wrote `text` as another split than the text's own (as a
    sampler may) with its logprobs. Faulty: the pipeline decoded the completion and encoded it
    again (the text's own ids, as many), keeping the engine's logprobs. Normal: the record keeps
    the engine's own ids."""
    own = list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    engine = other_split(lm.tokenizer, own)
    faulty, normal = [], []
    for k, prompt in enumerate(prompt_ids(lm)):
        logprobs = teacher_forced(lm, prompt, engine)
        base = {"prompt_ids": prompt, "logprobs": logprobs, "sampling": {"temperature": 1.0}}
        faulty.append({**base, "id": f"reencoded/{k}", "completion_ids": own})
        normal.append({**base, "id": f"engine/{k}", "completion_ids": engine})
    return faulty, normal
