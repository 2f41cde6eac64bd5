"""Inside each step: the logit lens and attention over the cache, for the engine's loop.

The engine attaches a Probe around its forwards and asks it for each step's records; the
probe knows the rows' prompts (for left padding and the token at each position) and keeps
the chosen tokens, so an attended position can be named by its token."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.inside import attention, lens

DEFAULT_TOP = 5  # top tokens / positions per layer when top_logprobs is 0


class Probe:
    """What the engine records inside a step: `lens` and/or `attention` (True: the mean over
    heads; "heads": also each head's own), per row."""

    def __init__(
        self, prompt_ids: Sequence[Sequence[int]], top_n: int, lens: bool = False, attention: bool | str = False
    ):
        if lens not in (True, False, None):
            raise InvalidParameter(f"lens must be true or false, got {lens!r}")
        if attention not in (True, False, None, "heads"):
            raise InvalidParameter(f"attention must be true, false or 'heads', got {attention!r}")
        self.lens, self.attention, self.heads = bool(lens), bool(attention), attention == "heads"
        self.top_n = top_n or DEFAULT_TOP
        self.rebase(prompt_ids)
        self._rows: list | None = None
        self._weights: dict | None = None
        self._un: lens.Unembedding | None = None
        self.keep = 1  # the last positions the next forward's captures keep (a verify forward: several)
        self.at = 0  # which of the kept positions the next `take` reads

    def rebase(self, prompt_ids: Sequence[Sequence[int]]) -> None:
        """The rows of the generation that starts now (speculative decoding decodes the prompts of
        a batch one after another): their left padding and their tokens by absolute position."""
        self.width = max(len(p) for p in prompt_ids)
        self.pads = [self.width - len(p) for p in prompt_ids]
        self.seqs = [list(p) for p in prompt_ids]

    @property
    def wanted(self) -> bool:
        return self.lens or self.attention

    @contextmanager
    def attached(self, model) -> Iterator[None]:
        """Hooks (lens) and the capturing attention function for the duration of a generation."""
        with ExitStack() as stack:
            if self.lens:
                self._un = lens.unembedding(model)
                self._rows = stack.enter_context(lens.capturing(model, lambda: self.keep))
            if self.attention:
                self._weights = stack.enter_context(attention.capturing(model, lambda: self.keep))
            yield

    def positions(self, n: int) -> None:
        """The next forward's captures keep its last `n` positions (one a step: a verify forward
        of speculative decoding makes the steps of a block); `take` reads the first until `select`."""
        self.keep, self.at = n, 0

    def select(self, at: int) -> None:
        """Which of the last forward's kept positions the next `take` reads (0: the first kept)."""
        self.at = at

    def _lens_rows(self) -> list:
        """The lens's (batch, hidden) rows of the selected position."""
        rows = self._rows or []
        return [r if r is None or r.dim() == 2 else r[:, self.at, :] for r in rows]

    def _attention_weights(self) -> dict:
        """The selected query's weights (batch, heads, kv_len), the keys after it (a later
        position of the same verify forward) cut off."""
        out = {}
        for layer, (w, vw) in (self._weights or {}).items():
            if w.dim() == 3:
                out[layer] = (w, vw)
                continue
            n = w.shape[2]
            seen = w.shape[-1] - (n - 1 - self.at)
            out[layer] = (w[:, :, self.at, :seen], vw[:, :, self.at, :seen])
        return out

    def take(self, index: int, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[list | None, list | None]:
        """(lens records, attention records), one per row, for the forward that produced step
        `index`'s raw `logits` (batch, vocab), whose chosen tokens are `tokens` (batch,)."""
        lens_rows = att_rows = None
        if self.lens:
            lens_rows = lens.measure(self._un, self._lens_rows(), logits, tokens, self.top_n)
        if self.attention:
            total = self.width + index  # columns of the padded sequence the query sees
            att_rows = attention.summarize(self._attention_weights(), total, self.pads, self.top_n, self.heads)
            for row, layers in enumerate(att_rows):
                name_positions(layers, self.seqs[row])
        for row, token in enumerate(tokens.tolist()):
            self.seqs[row].append(token)
        att = [{"layers": layers} for layers in att_rows] if att_rows is not None else None
        return lens_rows, att

    def snapshot(self) -> tuple:
        """What the last forward left (a branch starts from a step it does not recompute)."""
        return (list(self._rows) if self._rows is not None else None, dict(self._weights or {}))

    def restore(self, saved: tuple, seqs: Sequence[Sequence[int]]) -> None:
        """Back to a snapshot, with each row's tokens so far `seqs`."""
        rows, weights = saved
        if self._rows is not None:
            self._rows[:] = rows
        if self._weights is not None:
            self._weights.clear()
            self._weights.update(weights)
        self.seqs = [list(s) for s in seqs]


def name_positions(layers: list[dict], seq: Sequence[int]) -> list[dict]:
    """An attention record's layers with each attended position's token id (`seq`: the row's
    tokens by absolute position)."""
    for layer in layers:
        tops = [layer["top"], layer["value_weighted"]["top"], *(h["top"] for h in layer.get("heads", ()))]
        for t in (t for top in tops for t in top):
            t["token_id"] = seq[t["position"]]
    return layers


def check(compile: bool, lens_on: bool, attention_on: bool | str) -> None:
    if compile and (lens_on or attention_on):
        raise InvalidParameter("compile cannot be combined with lens or attention, got compile=True")


def with_texts(record: dict, text: Callable[[int], str]) -> dict:
    """A lens or attention record with each token id's text (as in a step's `top`)."""
    for layer in record["layers"]:
        layer["top"] = [_named(t, text) for t in layer["top"]]
        if "value_weighted" in layer:
            layer["value_weighted"]["top"] = [_named(t, text) for t in layer["value_weighted"]["top"]]
        for head in layer.get("heads", ()):
            head["top"] = [_named(t, text) for t in head["top"]]
    return record


def _named(t: dict, text: Callable[[int], str]) -> dict:
    head = {"position": t["position"]} if "position" in t else {}
    rest = {k: v for k, v in t.items() if k not in ("position", "token_id")}
    return {**head, "token_id": t["token_id"], "text": text(t["token_id"]), **rest}


def prompt_tokens(lm, probe: Probe | None, ids: Sequence[int]) -> dict:
    """With attention: each prompt token's own text, so a report can show every position."""
    if probe is None or not probe.attention:
        return {}
    from lmtrace.detokenize import TokenBytes

    return {"tokens": [TokenBytes(lm.tokenizer).text(t) for t in ids]}


def params(lm, probe: Probe | None) -> dict:
    """What a trace's params say about the lens and attention, where they were on."""
    out: dict = {}
    if probe is not None and probe.lens:
        out["lens"] = lens.unembedding(lm.model).describe()
    if probe is not None and probe.attention:
        heads = "mean and per head" if probe.heads else "mean"
        out["attention"] = {"sinks": attention.SINKS, "recent": attention.RECENT, "heads": heads}
    return out
