"""Hand-made records for the report tests: traces, score results and branches built as JSON
dicts, with the optional data other commands add (per-layer KV ledger, waterfall)."""

from __future__ import annotations

import math
from typing import Any

PAYLOAD = "</script><img src=x onerror=alert(1)>"
# one token per piece; the byte pieces spell 美 (E7 BE 8E) over three tokens
PIECES = ["Hello", " world", "\n", PAYLOAD, "", "", "美", " <b>&amp;</b>", "\u2028\u2029", "\u202eevil"]
BYTES = [None, None, None, None, [0xE7], [0xBE], [0x8E], None, None, None]


def _alt(token_id: int, text: str, logprob: float, sampled: float | None) -> dict[str, Any]:
    return {
        "token_id": token_id,
        "text": text,
        "bytes": list(text.encode()),
        "logprob": logprob,
        "sampled_logprob": sampled,
    }


def step(i: int, text: str, raw: list[int] | None, p: float, layers: bool = False) -> dict[str, Any]:
    lp = math.log(p)
    s = {
        "index": i,
        "token_id": 100 + i,
        "text": text,
        "bytes": raw if raw is not None else list(text.encode()),
        "logprob": lp,
        "sampled_logprob": math.log(min(1.0, p * 1.5)),
        "rank": 1 + i % 3,
        "entropy": 0.5 + i / 10,
        "sampled_entropy": 0.3 + i / 10,
        "top": [
            _alt(100 + i, text or "?", lp, math.log(min(1.0, p * 1.5))),
            _alt(900 + i, f"{PAYLOAD}{i}", math.log(0.04), None),
        ],
        "kv": {"seq_len": 5 + i, "bytes": 4096 * (5 + i)},
        "time_ms": 10.0 + i,
    }
    if layers:
        s["kv"]["layers"] = [
            {"layer": k, "kind": "full", "key_shape": [1, 2, 5 + i, 64], "dtype": "float32", "bytes": 2048 * (5 + i)}
            for k in range(2)
        ]
        s["waterfall"] = [
            {"stage": "raw", "allowed": 300, "mass_removed": 0.0, "entropy": 2.1, "chosen_prob": p, "chosen_rank": 1},
            {
                "stage": "top_p",
                "allowed": 12,
                "mass_removed": 0.1,
                "entropy": 1.2,
                "chosen_prob": 0.6,
                "chosen_rank": 1,
            },
        ]
    return s


def trace_dict(pieces: list[str] = PIECES, layers: bool = False, temperature: float = 0.8) -> dict[str, Any]:
    raws = BYTES if pieces is PIECES else [None] * len(pieces)
    steps = [step(i, t, raws[i], 0.95 * 0.7**i, layers) for i, t in enumerate(pieces)]
    d = {
        "schema_version": 1,
        "model": {
            "source": f"hand-made {PAYLOAD}",
            "config": {
                "architecture": "LlamaForCausalLM",
                "layers": 2,
                "attention_heads": 4,
                "kv_heads": 2,
                "attention": "GQA (group size 2)",
                "head_dim": 64,
                "hidden_size": 256,
                "vocab_size": 300,
                "context_length": 256,
                "parameters": 1234567,
            },
            "dtype": "float32",
            "device": "cpu",
        },
        "params": {
            "temperature": temperature,
            "top_k": 0,
            "top_p": 0.9,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "seed": 7,
            "max_new_tokens": len(pieces),
            "top_logprobs": 2,
            "stop": [PAYLOAD],
        },
        "prompt": {"text": f"Prompt {PAYLOAD}", "token_ids": [1, 2, 3, 4, 5]},
        "text": "".join(pieces),
        "token_ids": [s["token_id"] for s in steps],
        "finish_reason": "length",
        "stop_reason": None,
        "timing": {
            "prefill_ms": 12.0,
            "decode_ms": 100.0,
            "total_ms": 112.0,
            "prompt_tokens": 5,
            "generated_tokens": len(pieces),
            "decode_tokens_per_s": 90.0,
        },
        "versions": {"lmtrace": "0.1.0"},
        "steps": steps,
    }
    if layers:
        d["kv_anatomy"] = {
            "formula": "2 × layers × kv_heads × head_dim × positions × bytes",
            "kv_heads": 2,
            "sources": {"kv_heads": "num_key_value_heads = 2"},
            "mismatches": [3],
        }
    return d


def score_dict() -> dict[str, Any]:
    tokens = [{"token_id": 1, "text": "The", "logprob": None, "rank": None, "entropy": None, "top": []}]
    for i, text in enumerate([" cat", PAYLOAD, " sat"], start=1):
        tokens.append(
            {
                "token_id": 10 + i,
                "text": text,
                "logprob": math.log(0.5 / i),
                "rank": i,
                "entropy": 1.0 + i,
                "top": [_alt(10 + i, text, math.log(0.5 / i), None), _alt(50, " dog", math.log(0.2), None)],
            }
        )
    return {"tokens": tokens, "perplexity": 3.21, "total_logprob": -3.5, "bits_per_byte": 1.25, "model": "hand-made"}


def branches_dict() -> dict[str, Any]:
    a = trace_dict(["A", " b", " c", " d"])
    b = trace_dict(["A", " b", " x", " y"])
    for i, s in enumerate(b["steps"][2:], start=2):
        s["token_id"] = 500 + i
    b["token_ids"] = [s["token_id"] for s in b["steps"]]
    return {"branches": [a, b]}
