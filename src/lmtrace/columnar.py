"""The columnar file form of a step's `lens` and `attention` entries: per-layer arrays instead of
per-layer objects, token texts once per trace (a step's `token_texts` holds the ids it shows
first), an attended position's token id left to the trace's own sequence (prompt + generated
ids), and numbers written with float32's digits (the shortest decimal that reads back as the
same float32). Reading expands every entry back to the shape `Step.to_dict()` gives: the columnar
form is lossless, and an entry that would not come back equal is written as it is."""

from __future__ import annotations

import math
import struct
from typing import Any

FORM = 1  # a columnar trace's top-level `columnar` value
KEY = "columnar"
OLD_KEY = "packed"  # what files written before this name said (still read)
TEXTS = "token_texts"  # a columnar step's table of the token texts it shows first, {"id": text}

_F32 = struct.Struct("f")
_LENS_LAYER = ("layer", "top", "chosen_rank", "chosen_logprob", "entropy", "kl_to_final")
_LENS_TOP = ("token_id", "text", "logprob")
_ATT_TOP = ("position", "token_id", "text", "weight")
_MEAN = ("sink_mass", "recent_mass", "entropy")  # a mean (or one head's) record's numbers
_VALUED = ("sink_mass", "entropy")  # the value-weighted record's


def is_columnar(d: dict) -> bool:
    """Whether a trace dict read from a file holds its steps in the columnar form."""
    return d.get(KEY) is not None or d.get(OLD_KEY) is not None


class NotColumnar(Exception):
    """An entry whose columnar form would not read back equal (a float64 number, an unknown key)."""


def float32(x: float) -> float:
    """`x` rounded to the nearest float32 (as a Python float)."""
    return _F32.unpack(_F32.pack(x))[0]


def short(x: Any) -> float:
    """A float32 value as the float whose repr is the shortest decimal that reads back as it."""
    if type(x) is not float or not math.isfinite(x) or float32(x) != x:
        raise NotColumnar(x)
    for digits in (6, 7, 8):  # 9 significant digits always suffice for a float32
        y = float(f"{x:.{digits}g}")
        if float32(y) == x:
            return y
    return float(f"{x:.9g}")


def _keys(d: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(d, dict) or tuple(d) != keys:
        raise NotColumnar(d)


class Tokens:
    """What packing and unpacking share over a trace: its sequence by absolute position (the
    prompt's ids, then each step's token as the steps are read) and the token texts so far."""

    def __init__(self, prompt_ids: list[int]):
        self.seq = list(prompt_ids)
        self.texts: dict[int, str] = {}

    def text(self, token_id: int, new: dict[int, str]) -> str:
        return self.texts[token_id] if token_id in self.texts else new[token_id]


def _note(tokens: Tokens, new: dict[int, str], token_id: int, text: str) -> None:
    """Keeps a token's text for the table; one id has one text in a trace, or nothing packs."""
    if tokens.texts.get(token_id, new.get(token_id, text)) != text:
        raise NotColumnar(token_id)
    if token_id not in tokens.texts:
        new[token_id] = text


def pack_lens(lens: dict, tokens: Tokens, new: dict[int, str]) -> dict:
    _keys(lens, ("settled_at", "layers"))
    out: dict[str, list] = {k: [] for k in ("layer", "top", "logprob", *_LENS_LAYER[2:])}
    for x in lens["layers"]:
        _keys(x, _LENS_LAYER)
        for t in x["top"]:
            _keys(t, _LENS_TOP)
            _note(tokens, new, t["token_id"], t["text"])
        out["layer"].append(x["layer"])
        out["top"].append([t["token_id"] for t in x["top"]])
        out["logprob"].append([short(t["logprob"]) for t in x["top"]])
        out["chosen_rank"].append(x["chosen_rank"])
        for k in _LENS_LAYER[3:]:
            out[k].append(short(x[k]))
    return {"settled_at": lens["settled_at"], "layers": out}


def unpack_lens(lens: dict, tokens: Tokens, new: dict[int, str]) -> dict:
    p = lens["layers"]
    columns = zip(
        p["layer"], p["top"], p["logprob"], p["chosen_rank"], p["chosen_logprob"], p["entropy"], p["kl_to_final"]
    )
    layers = []
    for n, ids, lps, rank, c, h, kl in columns:
        top = [{"token_id": t, "text": tokens.text(t, new), "logprob": float32(x)} for t, x in zip(ids, lps)]
        layers.append(
            {
                "layer": n,
                "top": top,
                "chosen_rank": rank,
                "chosen_logprob": float32(c),
                "entropy": float32(h),
                "kl_to_final": float32(kl),
            }
        )
    return {"settled_at": lens["settled_at"], "layers": layers}


def _pack_summaries(items: list, numbers: tuple[str, ...], tokens: Tokens, new: dict[int, str]) -> dict:
    """[{top: [{position, token_id, text, weight}], *numbers}] as arrays: positions, weights, numbers."""
    out: dict[str, list] = {k: [] for k in ("position", "weight", *numbers)}
    for x in items:
        _keys(x, ("top", *numbers))
        for t in x["top"]:
            _keys(t, _ATT_TOP)
            if not 0 <= t["position"] < len(tokens.seq) or tokens.seq[t["position"]] != t["token_id"]:
                raise NotColumnar(t)
            _note(tokens, new, t["token_id"], t["text"])
        out["position"].append([t["position"] for t in x["top"]])
        out["weight"].append([short(t["weight"]) for t in x["top"]])
        for k in numbers:
            out[k].append(short(x[k]))
    return out


def _unpack_summaries(p: dict, numbers: tuple[str, ...], tokens: Tokens, new: dict[int, str]) -> list[dict]:
    out = []
    for k, (positions, weights) in enumerate(zip(p["position"], p["weight"])):
        ids = [tokens.seq[q] for q in positions]
        top = [
            {"position": q, "token_id": t, "text": tokens.text(t, new), "weight": float32(w)}
            for q, t, w in zip(positions, ids, weights)
        ]
        out.append({"top": top, **{n: float32(p[n][k]) for n in numbers}})
    return out


def pack_attention(attention: dict, tokens: Tokens, new: dict[int, str]) -> dict:
    _keys(attention, ("layers",))
    layers = attention["layers"]
    heads = bool(layers) and "heads" in layers[0]
    own = ("layer", "top", *_MEAN, "value_weighted", *(("heads",) if heads else ()))
    for x in layers:
        _keys(x, own)
        if heads and [h.get("head") for h in x["heads"]] != list(range(len(x["heads"]))):
            raise NotColumnar(x)
    mean = [{k: x[k] for k in ("top", *_MEAN)} for x in layers]
    out = {"layer": [x["layer"] for x in layers], **_pack_summaries(mean, _MEAN, tokens, new)}
    out["value_weighted"] = _pack_summaries([x["value_weighted"] for x in layers], _VALUED, tokens, new)
    if heads:
        if any(tuple(h) != ("head", "top", *_MEAN) for x in layers for h in x["heads"]):
            raise NotColumnar(attention)
        per_head = [[{k: h[k] for k in ("top", *_MEAN)} for h in x["heads"]] for x in layers]
        out["heads"] = [_pack_summaries(hs, _MEAN, tokens, new) for hs in per_head]
    return {"layers": out}


def unpack_attention(attention: dict, tokens: Tokens, new: dict[int, str]) -> dict:
    p = attention["layers"]
    mean = _unpack_summaries(p, _MEAN, tokens, new)
    valued = _unpack_summaries(p["value_weighted"], _VALUED, tokens, new)
    layers = [{"layer": n, **m, "value_weighted": v} for n, m, v in zip(p["layer"], mean, valued)]
    for x, heads in zip(layers, p.get("heads") or ()):
        x["heads"] = [{"head": h, **r} for h, r in enumerate(_unpack_summaries(heads, _MEAN, tokens, new))]
    return {"layers": layers}


_PACKERS = {"lens": (pack_lens, unpack_lens), "attention": (pack_attention, unpack_attention)}


def to_columns(step: dict, tokens: Tokens) -> dict:
    """A step's dict (`Step.to_dict()`) with its lens and attention in columns where they read back
    equal; `tokens` then holds the step's token and the texts it wrote. Steps go in order."""
    out, new = dict(step), {}
    for name, (pack, unpack) in _PACKERS.items():
        entry = step.get(name)
        if not isinstance(entry, dict):
            continue
        mine = dict(new)  # the texts this step shows first, this entry's added on success
        try:
            columns = pack(entry, tokens, mine)
        except (NotColumnar, KeyError, TypeError):
            continue
        if unpack(columns, tokens, mine) == entry:
            new = mine
            out[name] = columns
    if new:
        tokens.texts.update(new)
        out[TEXTS] = {str(k): v for k, v in new.items()}
    tokens.seq.append(step["token_id"])
    return out


def from_columns(step: dict, tokens: Tokens) -> dict:
    """A step read from a file, its columnar entries expanded (the inverse of to_columns)."""
    new = {int(k): v for k, v in (step.get(TEXTS) or {}).items()}
    out = {k: v for k, v in step.items() if k != TEXTS}
    for name, (_, unpack) in _PACKERS.items():
        entry = out.get(name)
        if isinstance(entry, dict) and isinstance(entry.get("layers"), dict):
            out[name] = unpack(entry, tokens, new)
    tokens.texts.update(new)
    tokens.seq.append(step["token_id"])
    return out
