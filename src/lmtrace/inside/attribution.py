"""Direct logit attribution at every generated token, exact: why this token and not that one.

The residual stream that enters the final norm at the last position is a sum of what each
block wrote into it: the embedding (the first layer's input) plus, per decoder layer, the
attention's output and the MLP's output (Gemma-2's: those after its sandwich norms). The final
norm is linear once its scale is frozen at this step's value (the standard linearisation:
RMSNorm's 1/rms, LayerNorm's 1/std and its mean subtraction, which is linear and folds into
each part); the unembedding difference row W_U[token] − W_U[against] then turns each written
vector into its share of the logit difference. What is left — the norm's bias, the head's bias,
the final logit soft-capping — are named parts of their own, so the parts sum to the raw
logit difference. Per head: each head's output through its slice of the output projection;
the heads of a layer (and its projection's bias, where it has one) sum to its attention part.

Forward hooks keep the last position of each forward that produced a step (as the logit lens
does, inside/lens.py), or its last n positions where one forward makes n steps (a speculative
block's verify forward; `at` reads one of them): nothing is recomputed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.inside import lens
from lmtrace.inside.hooks import Hooks

DEFAULT_AGAINST = "rank:2"


@dataclass
class Block:
    """One decoder layer's writes into the residual stream and its heads' projection."""

    attn: Any  # the module whose output is the attention's write (Gemma-2: its post-attention norm)
    mlp: Any  # the module whose output is the MLP's write (Gemma-2: its post-feedforward norm)
    o_proj: Any  # the attention's output projection: its input is the heads' outputs, concatenated
    heads: int  # attention heads (o_proj's input is heads * head_dim wide)
    post: Any = None  # Gemma-2's norm between o_proj and the residual (None: none)


@dataclass
class Parts:
    """What the hooks keep of one forward, at the last position: (batch, hidden) rows (a verify
    forward's last n positions: (batch, n, hidden), read one at a time through `at`)."""

    embed: torch.Tensor | None = None
    attn: list = field(default_factory=list)
    mlp: list = field(default_factory=list)
    heads_in: list = field(default_factory=list)  # o_proj's input (batch, heads * head_dim)
    post_in: list = field(default_factory=list)  # the sandwich norm's input (Gemma-2)
    final: torch.Tensor | None = None  # the residual entering the final norm


def row_of(parts: Parts, r: int) -> Parts:
    """Row r of a forward's captures (each tensor (1, ...)): a continuous batch's row keeps its own
    until its token is chosen, whatever forwards run meanwhile."""

    def one(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[r : r + 1]

    lists = [[one(t) for t in slot] for slot in (parts.attn, parts.mlp, parts.heads_in, parts.post_in)]
    return Parts(one(parts.embed), *lists, one(parts.final))


def at(parts: Parts, position: int) -> Parts:
    """The (batch, hidden) rows of kept position `position` (0: the first kept) where the hooks
    kept several ((batch, n, hidden)); `parts` itself where they kept one."""
    if parts.final is None or parts.final.dim() == 2:
        return parts

    def one(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, position]

    lists = [[one(t) for t in slot] for slot in (parts.attn, parts.mlp, parts.heads_in, parts.post_in)]
    return Parts(one(parts.embed), *lists, one(parts.final))


def blocks(model: Any) -> list[Block]:
    """Each decoder layer's attention, MLP and output projection (Llama-like and GPT-2-like)."""
    un = lens.unembedding(model)
    heads = model.config.get_text_config().num_attention_heads
    out = []
    for i, layer in enumerate(un.layers):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        mlp = getattr(layer, "mlp", None)
        o_proj = next((getattr(attn, n) for n in ("o_proj", "c_proj", "out_proj", "dense") if hasattr(attn, n)), None)
        if attn is None or mlp is None or o_proj is None:
            raise InvalidParameter(f"attribution needs each layer's attention, MLP and output projection, "
                                   f"got {type(layer).__name__} (layer {i})")  # fmt: skip
        post = getattr(layer, "post_attention_layernorm", None)
        if getattr(layer, "post_feedforward_layernorm", None) is not None:  # sandwich norms (Gemma-2)
            out.append(Block(post, layer.post_feedforward_layernorm, o_proj, heads, post))
        else:
            out.append(Block(attn, mlp, o_proj, heads))
    return out


def _last(t: Any, n: int) -> torch.Tensor:
    t = t[0] if isinstance(t, tuple) else t
    return t[:, -1, :].clone() if n == 1 else t[:, -n:, :].clone()  # (batch, seq, hidden) -> (batch, [n,] hidden)


@contextmanager
def capturing(an: Anatomy, keep: Callable[[], int] = lambda: 1) -> Iterator[Parts]:
    """Yields a Parts that each forward of the model refills at its last position; where `keep()`
    is more than one (a speculative block's verify forward), at its last `keep()` positions."""
    un, bs = an.un, an.blocks
    parts = Parts(attn=[None] * len(bs), mlp=[None] * len(bs), heads_in=[None] * len(bs), post_in=[None] * len(bs))
    # the final norm's input is the forward's only while a forward runs: the logit lens calls the
    # same norm on its layers' rows after it (lens + attribution would read the lens's input)
    live = [False]

    def pre(slot: list | None, i: int | str):
        def hook(module, args, kwargs):
            if i == "final" and not live[0]:
                return
            live[0] = i != "final"
            h = _last(args[0] if args else kwargs["hidden_states"], keep())
            if slot is None:
                setattr(parts, str(i), h)
            else:
                slot[i] = h

        return hook

    def post(slot: list, i: int):
        def hook(module, args, output):
            slot[i] = _last(output, keep())

        return hook

    with Hooks(un=un, blocks=bs) as hooks:
        hooks.add("blocks.0.resid_pre", pre(None, "embed"))
        hooks.add("norm.in", pre(None, "final"))
        for i, b in enumerate(bs):
            hooks.add(f"blocks.{i}.attn_out", post(parts.attn, i))
            hooks.add(f"blocks.{i}.mlp_out", post(parts.mlp, i))
            hooks.add(f"blocks.{i}.attn.z", pre(parts.heads_in, i))
            if b.post is not None:
                hooks.add(f"blocks.{i}.attn.o", pre(parts.post_in, i))
        yield parts


@dataclass
class Frozen:
    """A norm made linear at one input: norm(x) = gain * (x − mean(x) if centered) + bias."""

    gain: torch.Tensor  # (batch, hidden)
    centered: bool
    bias: torch.Tensor | None  # (hidden,)


def _eps(norm: Any) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    raise InvalidParameter(f"attribution: cannot find the epsilon of the norm {type(norm).__name__}")


def freeze(norm: Any, x: torch.Tensor, gain: torch.Tensor | None) -> Frozen:
    """The norm's linear map at inputs x (batch, hidden), its scale frozen at x's own value;
    `gain` the RMSNorm's (see `rms_gain`), None for a LayerNorm."""
    x = x.float()
    if isinstance(norm, torch.nn.LayerNorm):
        w = torch.ones(x.shape[-1]) if norm.weight is None else norm.weight.detach().float()
        scale = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)  # (batch, 1)
        bias = None if norm.bias is None else norm.bias.detach().float()
        return Frozen(scale * w.to(x.device), True, bias)
    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _eps(norm))
    return Frozen(scale * gain.to(x.device), False, None)


def rms_gain(norm: Any) -> torch.Tensor | None:
    """An RMSNorm's gain, w or 1 + w (Gemma's): whichever reproduces the module's own output on a
    probe vector (None: a LayerNorm). Run before any hook is attached."""
    if isinstance(norm, torch.nn.LayerNorm):
        return None
    weight = getattr(norm, "weight", None)
    if weight is None:
        raise InvalidParameter(f"attribution: the norm {type(norm).__name__} has no weight")
    w = weight.detach().float().cpu()
    probe = torch.linspace(-2.0, 3.0, w.numel())
    with torch.no_grad():
        y = norm(probe.to(weight.device, dtype=weight.dtype)[None]).float().cpu()[0]
    unit = probe * torch.rsqrt(probe.pow(2).mean() + _eps(norm))
    for gain in (w, 1.0 + w):
        if torch.allclose(unit * gain, y, rtol=1e-2, atol=1e-3):
            return gain
    raise InvalidParameter(f"attribution: the norm {type(norm).__name__} is neither RMSNorm nor LayerNorm")


@dataclass
class Anatomy:
    """What attribution reads a model through: its unembedding, blocks and norms' gains."""

    un: lens.Unembedding
    blocks: list[Block]
    final_gain: torch.Tensor | None
    post_gains: list  # per layer: the sandwich norm's gain (None: no sandwich norm)


def anatomy(model: Any) -> Anatomy:
    """The model's parts for attribution, checked (before hooks go on: it runs the norms once)."""
    un, bs = lens.unembedding(model), blocks(model)
    if getattr(un.head, "weight", None) is None:
        raise InvalidParameter("attribution needs an lm_head with a weight matrix (not packed weights)")
    return Anatomy(un, bs, rms_gain(un.norm), [None if b.post is None else rms_gain(b.post) for b in bs])


def _into_heads(o_proj: Any, w: torch.Tensor) -> torch.Tensor:
    """Row vectors w (batch, out) pulled back through the output projection: (batch, in)."""
    weight = o_proj.weight.detach()
    weight = weight if weight.dtype == torch.float32 else weight.float()
    if type(o_proj).__name__ == "Conv1D":  # GPT-2: weight (in, out), y = x @ W + b
        return w @ weight.T
    return w @ weight  # nn.Linear: weight (out, in)


def attribute(an: Anatomy, parts: Parts, logits: torch.Tensor, tokens: torch.Tensor,
              against: torch.Tensor) -> list[dict]:  # fmt: skip
    """One record per batch row: {token_id, against_token_id, logit_diff, parts, heads} for the
    forward whose last position gave the raw `logits` (batch, vocab); tokens, against (batch,)."""
    un, bs, head = an.un, an.blocks, an.un.head
    dev = parts.final.device
    tokens, against = tokens.to(dev), against.to(dev)
    d = head.weight[tokens].float() - head.weight[against].float()  # (batch, hidden)
    final = freeze(un.norm, parts.final, an.final_gain)
    u = d * final.gain
    if final.centered:  # u · (c − mean c) = (u − mean u) · c
        u = u - u.mean(-1, keepdim=True)
    comps = [parts.embed] + [t for pair in zip(parts.attn, parts.mlp) for t in pair]  # layers may sit on other devices
    values = torch.einsum("cbh,bh->bc", torch.stack([c.to(dev) for c in comps]).float(), u)  # (batch, 1 + 2 layers)
    names = ["embed"] + [f"L{i}.{k}" for i in range(len(bs)) for k in ("attn", "mlp")]
    extra: list[tuple[str, torch.Tensor]] = []
    if final.bias is not None:
        extra.append((f"{un.norm_name}.bias", d @ final.bias))
    if getattr(head, "bias", None) is not None:
        extra.append(("lm_head.bias", head.bias[tokens].float() - head.bias[against].float()))
    rows = torch.arange(logits.shape[0], device=logits.device)
    diff = (logits[rows, tokens.to(logits.device)] - logits[rows, against.to(logits.device)]).float().to(dev)
    if un.softcap is not None:  # what the soft-capping takes off the linear sum
        linear = values.sum(-1) + sum((v for _, v in extra), torch.zeros_like(diff))
        extra.append(("softcap", diff - linear))
    keys, heads = _heads(an, parts, u)
    extra_lists = [(n, v.tolist()) for n, v in extra]
    out = []
    for r, (vals, diff_r) in enumerate(zip(values.tolist(), diff.tolist())):
        record_parts = [{"component": n, "value": v} for n, v in zip(names, vals)]
        record_parts += [{"component": n, "value": v[r]} for n, v in extra_lists]
        out.append({"token_id": int(tokens[r]), "against_token_id": int(against[r]), "logit_diff": diff_r,
                    "parts": record_parts,
                    "heads": [{"layer": k[0], "head": k[1], "value": v} for k, v in zip(keys, heads[r])]})  # fmt: skip
    return out


def _heads(an: Anatomy, parts: Parts, u: torch.Tensor) -> tuple[list[tuple[int, int | str]], list[list[float]]]:
    """([(layer, head)], per batch row its values): each head's share, and each projection
    bias's (head "bias"), per layer; one transfer to Python for all of them."""
    keys: list[tuple[int, int | str]] = []
    values = []
    for i, b in enumerate(an.blocks):
        gain = an.post_gains[i]
        w = u if b.post is None else u * freeze(b.post, parts.post_in[i].to(u.device), gain).gain  # (batch, hidden)
        x = parts.heads_in[i].float()  # (batch, heads * head_dim), on the layer's device
        per = (x * _into_heads(b.o_proj, w.to(x.device))).view(x.shape[0], b.heads, -1).sum(-1)  # (batch, heads)
        values.append(per.to(u.device))
        keys += [(i, h) for h in range(b.heads)]
        bias = getattr(b.o_proj, "bias", None)
        if bias is not None:
            values.append((w.to(bias.device) @ bias.detach().float()).to(u.device)[:, None])  # (batch, 1)
            keys.append((i, "bias"))
    return keys, torch.cat(values, -1).tolist()


def resolve_against(value: str | int, tokenizer: Any, vocab: int) -> tuple[str, int]:
    """("rank", N) or ("id", token id) for an --against value, checked against the tokenizer:
    a text must be one token of it (its own spelling, e.g. "Ġthe", or a text that encodes to
    exactly one token), an id and a rank within the vocabulary."""
    from lmtrace.arguments import against

    kind, x = against(value)
    if kind == "rank":
        if x > vocab - 1:
            raise InvalidParameter(f"against: rank must be in 1..{vocab - 1} (the vocabulary has {vocab}), got {x}")
        return ("rank", int(x))
    if kind == "id":
        if x >= vocab:
            raise InvalidParameter(f"against: token id must be in 0..{vocab - 1}, got {x}")
        return ("id", int(x))
    own = tokenizer.get_vocab().get(x)
    if own is not None and own < vocab:
        return ("id", int(own))
    ids = list(tokenizer(x, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        raise InvalidParameter(f"against: {x!r} is not one token of the tokenizer (it encodes to {len(ids)})")
    return ("id", int(ids[0]))


def against_ids(against: tuple[str, int], logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The other token of each row (batch,): a fixed id, or the token at rank N of the raw
    `logits` (batch, vocab) — the next one where that is the chosen token itself, so that with
    greedy decoding rank:1 and rank:2 both name the runner-up."""
    kind, x = against
    if kind == "id":
        return torch.full_like(tokens, x)
    top = torch.topk(logits, x + 1, dim=-1).indices  # (batch, N + 1)
    at = top[:, x - 1]
    return torch.where(at == tokens.to(at.device), top[:, x], at)
