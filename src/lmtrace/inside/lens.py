"""The logit lens, exact: every layer's residual stream at the last position, read through the
model's own final norm, unembedding and logit soft-capping.

Forward hooks keep one row per layer (the last position only): the input of the first decoder
layer (the embedding output, `layer` 0) and each decoder layer's output (`layer` i). The last
decoder layer's output is the residual stream *before* the final norm, so every layer goes
through the norm exactly once; its row is the step's own distribution. Per layer only small
records leave the device: top tokens, the chosen token's rank and logprob, entropy, KL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.inside.hooks import Hooks
from lmtrace.logits import measure as numbers


@dataclass
class Unembedding:
    """What the lens reads a residual stream through: the model's own modules."""

    layers: Any  # the decoder layers (a ModuleList)
    norm: Any  # the final norm
    head: Any  # the output embedding (lm_head)
    softcap: float | None  # config.final_logit_softcapping (Gemma-2)
    tied: bool  # lm_head shares its weight with the input embeddings
    norm_name: str

    def describe(self) -> dict[str, Any]:
        """How the lens reads layers, for the trace's header."""
        return {
            "norm": self.norm_name,
            "unembedding": "input embeddings (tied)" if self.tied else "lm_head",
            "tied_embeddings": self.tied,
            "softcap": self.softcap,
        }

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of residual streams h (..., hidden) -> (..., vocab), as the model's head."""
        logits = self.head(self.norm(h))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


def unembedding(model) -> Unembedding:
    """Finds the decoder layers, final norm and head of a causal LM (Llama-like or GPT-2-like)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    names = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
    norm_name = next((n for n in names if getattr(decoder, n, None) is not None), None)
    head = model.get_output_embeddings()
    if layers is None or norm_name is None or head is None:
        raise InvalidParameter(f"lens needs decoder layers, a final norm and an lm_head, got {type(model).__name__}")
    embed = model.get_input_embeddings()
    tied = _tied(head, embed)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return Unembedding(layers, getattr(decoder, norm_name), head, softcap, tied, norm_name)


def _tied(head: Any, embed: Any) -> bool:
    """Whether the head shares the input embedding's weights: the same tensor, or (packed GGUF
    layers, which hold no `weight`) the same GGUF tensor."""
    if embed is None:
        return False
    weight = getattr(head, "weight", None)
    if weight is not None:
        return weight is getattr(embed, "weight", None)
    source = getattr(head, "source", None)
    return source is not None and source == getattr(embed, "source", None)


@contextmanager
def capturing(model, keep: Callable[[], int] = lambda: 1) -> Iterator[list[torch.Tensor | None]]:
    """Yields a list that each forward fills with (batch, hidden) last-position rows:
    [embedding output, layer 0's output, ..., last layer's output]; where `keep()` is more than
    one (a speculative block's verify forward), the last `keep()` positions (batch, keep, hidden)."""
    un = unembedding(model)
    rows: list[torch.Tensor | None] = [None] * (len(un.layers) + 1)

    def last(h: torch.Tensor) -> torch.Tensor:
        n = keep()
        return h[:, -1, :].clone() if n == 1 else h[:, -n:, :].clone()  # (batch, seq, hidden) -> (batch, [n,] hidden)

    def first(module, args, kwargs):
        rows[0] = last(args[0] if args else kwargs["hidden_states"])

    def after(i: int):
        def hook(module, args, output):
            rows[i + 1] = last(output[0] if isinstance(output, tuple) else output)

        return hook

    with Hooks(model, un=un) as hooks:
        hooks.add("blocks.0.resid_pre", first)
        for i in range(len(un.layers)):
            hooks.add(f"blocks.{i}.resid_post", after(i))
        yield rows


def measure(
    un: Unembedding, rows: list[torch.Tensor], logits: torch.Tensor, chosen: torch.Tensor, top_n: int
) -> list[dict]:
    """Per batch row {settled_at, layers: [{layer, top: [{token_id, logprob}], chosen_rank,
    chosen_logprob, entropy, kl_to_final}]} for the chosen tokens (batch,). The last layer's row
    is the step's own `logits` (batch, vocab): the same norm and head over the same residual,
    computed once by the model (tests check the lens reproduces it)."""
    h = torch.stack(rows[:-1])  # (layers, batch, hidden): all but the last layer's output
    lp = torch.log_softmax(torch.cat([un.logits(h), logits[None]]), dim=-1)  # (layers + 1, batch, vocab)
    final = lp[-1]
    index = chosen[None, :, None].expand(lp.shape[0], -1, 1)
    chosen_lp = lp.gather(-1, index)  # (layers + 1, batch, 1)
    ranks = numbers.rank(lp, chosen_lp)
    # one pass each over (layers + 1, batch, vocab): lp is finite (a log-softmax of finite logits)
    entropy = -torch.einsum("lbv,lbv->lb", lp.exp(), lp)
    entropy[-1] = numbers.entropy(final)  # the final row as the step's own entropy, to the bit
    kl = -entropy[-1] - torch.einsum("lbv,bv->lb", lp, final.exp())  # KL(final || layer), nats
    kl[-1] = 0.0  # the final layer against itself, whatever the rounding of the two sums
    top_lp, top_ids = torch.topk(lp, max(top_n, 1), dim=-1)  # (layers + 1, batch, n)
    floats = torch.cat([chosen_lp, entropy[..., None], kl[..., None], top_lp], -1).transpose(0, 1).tolist()
    ints = torch.cat([ranks[..., None], top_ids], -1).transpose(0, 1).tolist()
    token = chosen.tolist()
    out = []
    for f_row, i_row, tok in zip(floats, ints, token):
        layers = [
            {
                "layer": n,
                "top": [{"token_id": t, "logprob": x} for t, x in zip(i[1 : 1 + top_n], f[3 : 3 + top_n])],
                "chosen_rank": i[0],
                "chosen_logprob": f[0],
                "entropy": f[1],
                "kl_to_final": max(f[2], 0.0),
            }
            for n, (f, i) in enumerate(zip(f_row, i_row))
        ]
        out.append({"settled_at": settled(i_row, tok), "layers": layers})
    return out


def settled(ints: list[list[int]], token: int) -> int | None:
    """The first layer from which every layer's top-1 is the chosen token (None where the final
    layer's top-1 is another token, as when sampling picked a less likely one)."""
    at = None
    for n in range(len(ints) - 1, -1, -1):
        if ints[n][1] != token:
            break
        at = n
    return at
