"""A long trace built from records alone (no model): the bundled model's shape (30 layers, 3 KV
heads of 64, top 5 alternatives, the lens over 31 rows and the attention over 30 layers), its
numbers drawn from a seeded generator and rounded to float32, as a real trace's are. For tests
of what grows with the steps: file sizes, packing, the report's lazy loading."""

from __future__ import annotations

import random
import struct

from lmtrace.records import Alternative, Step, Trace

LAYERS, VOCAB, PROMPT = 30, 49152, [1, 9690, 314, 2744, 2]
_F = struct.Struct("f")


def f32(x: float) -> float:
    return _F.unpack(_F.pack(x))[0]


def _text(token_id: int) -> str:
    return f" w{token_id}"


def _kv(seq_len: int) -> dict:
    shape = [1, 3, seq_len, 64]
    per = 2 * 3 * seq_len * 64 * 4
    layers = [{"layer": n, "kind": "full_attention", "window": None, "keys": shape, "values": shape,
               "dtype": "float32", "bytes": per, "bytes_used": per} for n in range(LAYERS)]
    return {"seq_len": seq_len, "bytes": per * LAYERS, "expected_bytes": per * LAYERS, "layers": layers}


def _lens(rng: random.Random, token: int) -> dict:
    layers = []
    for n in range(LAYERS + 1):
        ids = [token if n == LAYERS else rng.randrange(VOCAB)] + [rng.randrange(VOCAB) for _ in range(4)]
        lps = sorted((f32(-rng.random() * 8) for _ in ids), reverse=True)
        top = [{"token_id": t, "text": _text(t), "logprob": lp} for t, lp in zip(ids, lps)]
        final = n == LAYERS
        layers.append({"layer": n, "top": top, "chosen_rank": 1 if final else rng.randrange(1, 5000),
                       "chosen_logprob": lps[0] if final else f32(-rng.random() * 20),
                       "entropy": f32(rng.random() * 5), "kl_to_final": 0.0 if final else f32(rng.random() * 9)})
    return {"settled_at": LAYERS, "layers": layers}


def _summary(rng: random.Random, seq: list[int], recent: bool) -> dict:
    positions = rng.sample(range(len(seq)), min(5, len(seq)))
    top = [{"position": p, "token_id": seq[p], "text": _text(seq[p]), "weight": f32(rng.random())} for p in positions]
    out = {"top": top, "sink_mass": f32(rng.random())}
    if recent:
        out["recent_mass"] = f32(rng.random())
    return {**out, "entropy": f32(rng.random() * 3)}


def _attention(rng: random.Random, seq: list[int]) -> dict:
    layers = [{"layer": n, **_summary(rng, seq, True), "value_weighted": _summary(rng, seq, False)}
              for n in range(LAYERS)]
    return {"layers": layers}


def long_trace(steps: int, inside: bool = True, seed: int = 0) -> Trace:
    """A greedy trace of `steps` steps, with the lens and the attention where `inside`."""
    rng = random.Random(seed)
    seq, out = list(PROMPT), []
    for i in range(steps):
        token = rng.randrange(3, VOCAB)
        lp = f32(-rng.random() * 2)
        top = [Alternative(t, _text(t), list(_text(t).encode()), f32(lp - k), f32(lp - k)) for k, t in
               enumerate([token, *(rng.randrange(VOCAB) for _ in range(4))])]
        step = Step(i, token, _text(token), list(_text(token).encode()), lp, lp, 1, f32(rng.random() * 4),
                    f32(rng.random() * 4), top, _kv(len(seq)), 80.0 + rng.random())
        if inside:
            step.lens, step.attention = _lens(rng, token), _attention(rng, seq)
        out.append(step)
        seq.append(token)
    params = {"max_new_tokens": steps, "temperature": 0.0, "top_logprobs": 5, "stop_on_eos": False, "chat": False}
    if inside:
        params |= {"lens": {"norm": "final"}, "attention": {"sinks": 4, "recent": 32, "heads": "mean"}}
    return Trace(
        model={"source": "synthetic", "config": {"layers": LAYERS}, "dtype": "float32", "device": "cpu"},
        params=params,
        prompt={"text": "Tell me a long story.", "token_ids": PROMPT, **({"tokens": [_text(t) for t in PROMPT]}
                                                                         if inside else {})},
        text="".join(s.text for s in out), token_ids=[s.token_id for s in out], finish_reason="length",
        stop_reason=None, timing={"total_ms": 80.0 * steps}, versions={"lmtrace": "test"}, steps=out,
    )
