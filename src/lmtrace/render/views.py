"""Token views: what the HTML page shows of one step (or one scored token), as plain data that
both the template and the page's script read. Works on the JSON dicts, so steps from traces,
score results and branches all go through the same function."""

from __future__ import annotations

import math
import os
import unicodedata
from typing import Any

from lmtrace.render.html import inside
from lmtrace.render.html.attribution import attribution_view
from lmtrace.render.speculative import verdict
from lmtrace.render.tokens import SCALE, escape, show_bytes

# step fields that token_view shows itself; other fields reach the panel as "extra"
_KNOWN = {
    "index",
    "token_id",
    "text",
    "bytes",
    "logprob",
    "sampled_logprob",
    "rank",
    "entropy",
    "sampled_entropy",
    "top",
    "kv",
    "time_ms",
    "waterfall",
    "problems",
    "grammar",
    "draft",
}
# a step where the grammar removed more than this share of the raw probability is marked
GRAMMAR_FLAG = 0.5


def bucket(p: float | None) -> int:
    """Index into SCALE (0 = most likely); -1 when there is no probability."""
    if p is None:
        return -1
    for i, (threshold, _) in enumerate(SCALE):
        if p >= threshold:
            return i
    return len(SCALE) - 1


def _prob(logprob: float | None) -> float | None:
    if logprob is None or not isinstance(logprob, (int, float)):
        return None
    return 0.0 if math.isinf(logprob) else math.exp(logprob)


def _round(x: Any, digits: int = 6) -> Any:
    """Shorter JSON for the page; non-finite numbers become null (JSON has no infinities)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    return x


def _mark(ch: str) -> tuple[str, str]:
    """A character as shown in a token box, and its css class."""
    if ch in " \n\t\r":
        return escape(ch), "ws"
    # invisible or reordering characters (zero-width, bidi overrides, odd spaces) as code points
    if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Zs", "Co", "Cn"):
        return (escape(ch) if ord(ch) < 128 else f"\\u{ord(ch):04x}"), "ctl"
    return ch, ""


def pieces(text: str, raw: list[int] | None) -> list[tuple[str, str]]:
    """(shown text, css class) runs: whitespace and control characters as visible marks; a
    piece that is still an incomplete character shows its bytes as <0xNN>."""
    if text == "" and raw:
        return [(show_bytes(raw), "byte")]
    out: list[tuple[str, str]] = []
    for ch in text:
        shown, cls = _mark(ch)
        if out and out[-1][1] == cls:
            out[-1] = (out[-1][0] + shown, cls)
        else:
            out.append((shown, cls))
    return out or [("∅", "ctl")]


def _alternative(a: dict[str, Any], chosen: int | None) -> dict[str, Any]:
    raw = a.get("bytes")
    return {
        "id": a.get("token_id"),
        "shown": show_bytes(raw) if raw is not None else escape(a.get("text", "")),
        "p": _round(_prob(a.get("logprob"))),
        "sp": _round(_prob(a.get("sampled_logprob"))),
        "chosen": a.get("token_id") == chosen,
    }


def token_view(step: dict[str, Any], i: int) -> dict[str, Any]:
    """The page's data for one step or scored token. `pieces` is for the template only."""
    text, raw = step.get("text") or "", step.get("bytes")
    p, sp = _prob(step.get("logprob")), _prob(step.get("sampled_logprob"))
    own = show_bytes(raw) if raw is not None else escape(text)
    shown = "".join(t for t, _ in pieces(text, raw))
    view: dict[str, Any] = {
        "i": step.get("index", i),
        "id": step.get("token_id"),
        "shown": shown,
        "own": own,
        "kind": "byte" if text == "" and raw else ("completes" if own != escape(text) else ""),
        "nl": "\n" in text,
        "p": _round(p),
        "sp": _round(sp),
        "lp": _round(step.get("logprob")),
        "rank": step.get("rank"),
        "H": _round(step.get("entropy")),
        "sH": _round(step.get("sampled_entropy")),
        "ms": _round(step.get("time_ms"), 4),
        "top": [_alternative(a, step.get("token_id")) for a in step.get("top") or []],
        "r": bucket(p if p is not None else sp),  # a trace of processed scores only: coloured by them
        "s": bucket(sp if sp is not None else p),
        "pieces": pieces(text, raw),
    }
    if isinstance(step.get("kv"), dict):
        view["kv"] = kv_view(step["kv"])
    if isinstance(step.get("waterfall"), list):
        view["waterfall"] = step["waterfall"]
    if isinstance(step.get("lens"), dict):  # lmtrace.inside.lens / lmtrace.inside.attention, compacted
        view["lens"] = inside.lens_view(step["lens"])
    if isinstance(step.get("attention"), dict):
        view["att"] = inside.attention_view(step["attention"])
    if isinstance(step.get("attribution"), dict):  # lmtrace.inside.attribution
        view["attr"] = attribution_view(step["attribution"])
    if isinstance(step.get("problems"), list) and step["problems"]:  # a watched loop's cache misuse
        view["problems"] = [str(p.get("message", p)) if isinstance(p, dict) else str(p) for p in step["problems"]]
    extra = {k: v for k, v in step.items() if k not in _KNOWN and isinstance(v, (str, int, float, bool))}
    g = step.get("grammar")
    if isinstance(g, dict):  # a constrained step (lmtrace.logits.grammar)
        extra["grammar allowed"] = g.get("allowed")
        extra["removed by the grammar"] = _round(g.get("removed_mass"))
        extra["p under the constraint"] = _round(_prob(g.get("logprob")))
        view["grammar_chose"] = (g.get("removed_mass") or 0.0) > GRAMMAR_FLAG
    if "draft" in step and (isinstance(step["draft"], dict) or step["draft"] is None):  # speculative decoding
        extra["draft"] = verdict(step["draft"])
    if extra:
        view["extra"] = extra
    return view


def kv_view(kv: dict[str, Any]) -> dict[str, Any]:
    """A step's KV record for the page: its layers as a table (`cols`, then a row of values per
    layer) rather than an object per layer, which would repeat every name at every layer and step."""
    layers = kv.get("layers")
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        return kv
    cols = list(dict.fromkeys(k for x in layers for k in x))
    return {
        **{k: v for k, v in kv.items() if k != "layers"},
        "cols": cols,
        "rows": [[x.get(c) for c in cols] for x in layers],
    }


def token_views(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [token_view(s, i) for i, s in enumerate(steps)]


def for_script(views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The views without the template-only fields."""
    return [{k: v for k, v in view.items() if k != "pieces"} for view in views]


def cumulative_logprob(steps: list[dict[str, Any]]) -> float:
    return sum(s["logprob"] for s in steps if isinstance(s.get("logprob"), (int, float)))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """The number of tokens two sequences share at their beginning."""
    return len(os.path.commonprefix([list(a), list(b)]))


def mark_divergence(branches: list[list[dict[str, Any]]], token_ids: list[list[int]]) -> list[int]:
    """Marks each branch's views from where it leaves the first branch (`div`, and `fork` on the
    first differing token); returns each branch's shared-prefix length."""
    first = token_ids[0]
    prefixes = [len(first)] + [shared_prefix(first, ids) for ids in token_ids[1:]]
    if len(prefixes) > 1:
        prefixes[0] = min(prefixes[1:])
    for views, n in zip(branches, prefixes):
        for v in views[n:]:
            v["div"] = True
        if n < len(views):
            views[n]["fork"] = True
    return prefixes


def raw_known(views: list[dict[str, Any]]) -> bool:
    """False for a trace that holds only the processed distribution (from_generate with scores only)."""
    return any(v["p"] is not None for v in views) or not any(v["sp"] is not None for v in views)


def sampling_differs(views: list[dict[str, Any]]) -> bool:
    """True when the processed distribution differs from the raw one for some chosen token."""
    return any(v["sp"] is not None and v["p"] is not None and abs(v["sp"] - v["p"]) > 1e-6 for v in views)
