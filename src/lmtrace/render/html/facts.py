"""The report's header as (group title, [(label, value), ...]): model and architecture,
sampling parameters and seed, timings. Values are formatted here; the template only prints
them. Every field is read with .get: hand-made or older records may lack some."""

from __future__ import annotations

import json
from typing import Any

from lmtrace.render.html.svg import human_bytes

Group = tuple[str, list[tuple[str, str]]]

_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "logit_bias": {}}
_ORIGINS = {
    "lmtrace": "lmtrace's own loop",
    "model.generate": "model.generate (from_generate)",
    "watch": "a watched loop (watch, record=True)",
    "vllm": "vLLM (batch --engine vllm)",
}
_DISTRIBUTIONS = {"both": "raw and processed", "raw": "raw only", "processed": "processed only"}


def value(v: Any, key: str = "") -> str:
    """A record value as short text: floats to 4 significant digits (whole from 1000 on), byte
    counts in KiB/MiB."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int) and "bytes" in key:
        return f"{human_bytes(v)} ({v:,})"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def _count(n: Any) -> str:
    if not isinstance(n, int):
        return value(n)
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def model_group(model: Any) -> Group:
    if not isinstance(model, dict):
        return "Model", [("source", value(model))]
    c = model.get("config") or {}
    rows = [("source", value(model.get("source")))]
    if c:
        rows += [
            ("architecture", value(c.get("architecture"))),
            ("layers", value(c.get("layers"))),
            *([("sliding window", value(c["sliding"]))] if c.get("sliding") else []),
            (
                "heads",
                f"{value(c.get('attention_heads'))}, {value(c.get('kv_heads'))} KV ({value(c.get('attention'))})",
            ),
            ("head_dim", value(c.get("head_dim"))),
            ("hidden, vocab", f"{value(c.get('hidden_size'))}, {value(c.get('vocab_size'))}"),
            ("context", value(c.get("context_length"))),
            ("parameters", _count(c.get("parameters"))),
        ]
    rows.append(("dtype, device", f"{value(model.get('dtype'))}, {value(model.get('device'))}"))
    return "Model", rows


def sampling_group(p: dict[str, Any]) -> Group:
    if p.get("settings") == "unknown":  # model.generate without its settings, or a watched loop
        return "Sampling", [("decoding", "not recorded"), ("top_logprobs", value(p.get("top_logprobs")))]
    if p.get("num_beams"):
        rows = [("decoding", f"beam search, {p['num_beams']} beams")]
        rows += [(k, value(p[k])) for k, off in _OFF.items() if k in p and p[k] != off]
        return "Sampling", rows + [("max_new_tokens", value(p.get("max_new_tokens")))]
    greedy = p.get("temperature") == 0
    rows = [("decoding", "greedy" if greedy else "sampling")]
    if not greedy:
        rows += [("temperature", value(p.get("temperature"))), ("seed", value(p.get("seed")))]
    rows += [(k, value(p[k])) for k, off in _OFF.items() if k in p and p[k] != off]
    rows += [("max_new_tokens", value(p.get("max_new_tokens"))), ("top_logprobs", value(p.get("top_logprobs")))]
    if p.get("stop"):
        rows.append(("stop", value(p["stop"])))
    if p.get("chat"):
        rows.append(("chat template", "yes"))
    return "Sampling", rows + _constraint_rows(p)


def _constraint_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    """The constraint a constrained generation followed (lmtrace.logits.grammar), shortened."""
    for name in ("json_schema", "regex", "choice", "grammar"):
        if p.get(name):
            shown = p[name] if isinstance(p[name], str) else json.dumps(p[name], ensure_ascii=False)
            shown = shown if len(shown) <= 60 else shown[:59] + "…"
            extra = f" ({p.get('json_whitespace', 'compact')} whitespace)" if name == "json_schema" else ""
            return [("constraint", f"{name}{extra}"), (name, shown)]
    return []


def run_group(d: dict[str, Any]) -> Group:
    t = d.get("timing") or {}
    prefill = f", prefill {value(t['prefill_ms'])} ms" if t.get("prefill_ms") is not None else ""
    rows = [
        ("trace of", _ORIGINS.get(d.get("origin", "lmtrace"), value(d.get("origin")))),
        ("distributions", _DISTRIBUTIONS.get(d.get("distributions", "both"), value(d.get("distributions")))),
        ("prompt", f"{value(t.get('prompt_tokens'))} tokens{prefill}"),
        ("generated", f"{value(t.get('generated_tokens'))} tokens"),
    ]
    if t.get("decode_tokens_per_s"):
        rows.append(("decode speed", f"{t['decode_tokens_per_s']:.1f} tok/s"))
    if t.get("total_ms") is not None:
        rows.append(("total", f"{value(t['total_ms'])} ms"))
    else:  # made after the run (from model.generate's output): no clock saw it
        rows.append(("times", "not recorded (the trace was made after the run)"))
    finish = value(d.get("finish_reason"))
    if d.get("stop_reason") is not None:
        finish += f" ({d['stop_reason']!r})"
    rows.append(("finish", finish))
    return "Run", rows


def trace_groups(d: dict[str, Any]) -> list[Group]:
    groups = [model_group(d.get("model")), sampling_group(d.get("params") or {}), run_group(d)]
    spec = d.get("speculative")
    if isinstance(spec, dict):  # speculative decoding: the draft and what it cost
        keys = ("draft", "draft_tokens", "mean_accepted_per_block", "blocks", "target_forwards", "draft_forwards")
        rows = [(k.replace("_", " "), value(spec.get(k), k)) for k in keys if spec.get(k) is not None]
        groups.append(("Draft", rows))
    u = d.get("uncertainty")
    if isinstance(u, dict) and "deepconf" in u:  # --uncertainty: the sequence scores (docs/uncertainty.md)
        groups.append(uncertainty_group(u))
    return groups


def uncertainty_group(u: dict[str, Any]) -> Group:
    """The answer's scores: raw, with the processed ones beside them where it was sampled."""

    def both(key: str, inner: str | None = None) -> str:
        raw = u.get(key) if inner is None else (u.get(key) or {}).get(inner)
        out = value(raw)
        if f"sampled_{key}" in u:
            done = u[f"sampled_{key}"] if inner is None else (u[f"sampled_{key}"] or {}).get(inner)
            out += f" (processed {value(done)})"
        return out

    rows = [
        ("−Σ log p (msp)", both("msp")),
        ("mean NLL", both("mean_nll")),
        ("perplexity", both("perplexity")),
        ("mean / max entropy", f"{both('mean_entropy')} / {both('max_entropy')}"),
    ]
    rows += [
        (f"DeepConf {name.replace('_', ' ')}", both("deepconf", name))
        for name in ("mean", "bottom10", "lowest_group", "tail")
    ]
    low = u.get("lowest_token")
    if low:
        rows.append(("least likely token", f"{low['text']!r} at step {low['index']} ({value(low['logprob'])})"))
    return "How sure", rows


def scalars(d: dict[str, Any], skip: set[str]) -> list[tuple[str, str]]:
    """The top-level plain values of a record: new fields show without a change here."""
    return [(k, value(v, k)) for k, v in d.items() if k not in skip and isinstance(v, (str, int, float, bool))]


def score_groups(d: dict[str, Any]) -> list[Group]:
    first = ("perplexity", "total_logprob", "bits_per_byte")
    rows = [(k, value(d[k], k)) for k in first if k in d]
    rows.append(("tokens", str(len(d["tokens"]))))
    rows += scalars(d, set(first) | {"schema_version", "model"})
    groups = [("Score", rows)]
    if d.get("model") is not None:
        groups.insert(0, model_group(d["model"]))
    return groups


def flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """A nested dict (the KV anatomy, for one) as dotted labels and values."""
    rows: list[tuple[str, str]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            rows += flat(v, f"{prefix}{k}.")
        else:
            rows.append((f"{prefix}{k}", value(v, str(k))))
    return rows
