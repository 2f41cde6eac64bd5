"""lmtrace's own numbers for the audit: the server's tokens mapped to this tokenizer's ids by
their bytes, then teacher-forced through the model in one uncached forward pass (float32
log-softmax). Never the server's numbers: only its tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmtrace.comparison.core import Vocabulary, prompt_ids
from lmtrace.comparison.parse import Reported, Token
from lmtrace.detokenize import TokenBytes
from lmtrace.logits import sampling
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams

KEEP = 6  # teacher-forced passes kept: probes look at the same answer more than once


@dataclass
class Forced:
    """One teacher-forced pass over prompt + tokens."""

    prompt_ids: list[int]
    ids: list[int]
    logits: torch.Tensor  # (len(prompt) + len(ids) - 1, vocab) float32: row i predicts position i + 1
    logprobs: torch.Tensor  # the same rows, raw log-softmax

    def generated(self) -> torch.Tensor:
        """(len(ids), vocab): the rows that predict the tokens after the prompt."""
        return self.logprobs[len(self.prompt_ids) - 1 :]

    def token_logprobs(self) -> list[float]:
        rows = self.generated()
        return rows.gather(-1, torch.tensor(self.ids)[:, None])[:, 0].tolist() if self.ids else []

    def prompt_logprobs(self) -> list[float]:
        """The logprobs of prompt tokens 1.. (token 0 has no context)."""
        rows = self.logprobs[: len(self.prompt_ids) - 1]
        return rows.gather(-1, torch.tensor(self.prompt_ids[1:])[:, None])[:, 0].tolist()

    def processed(self, temperature: float) -> list[float]:
        """The tokens' logprobs under the distribution a sampler draws from at `temperature`."""
        params = SamplingParams(temperature=temperature, max_new_tokens=1)
        rows = self.logits[len(self.prompt_ids) - 1 :]
        used = torch.log_softmax(sampling.process_logits(rows, params, None), -1)
        return used.gather(-1, torch.tensor(self.ids)[:, None])[:, 0].tolist() if self.ids else []


class Reference:
    """The model the server is said to serve, as the audit's oracle."""

    def __init__(self, lm: LM):
        self.lm = lm
        self.vocab = Vocabulary(lm.tokenizer)
        self.token_bytes = TokenBytes(lm.tokenizer)
        self.special = set(getattr(lm.tokenizer, "all_special_ids", []) or [])
        self.end = set(lm.eos_token_ids)
        self._forced: dict[tuple[tuple[int, ...], tuple[int, ...]], Forced] = {}

    @property
    def source(self) -> str:
        return self.lm.source

    def prompt_ids(self, text: str) -> list[int]:
        """A completion prompt's ids, as lmtrace (and vLLM) tokenize it: with special tokens."""
        return prompt_ids(self.lm, Reported("openai-completions", [], prompt=text))

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat template with the assistant's opening, tokenized without special tokens."""
        return prompt_ids(self.lm, Reported("openai-chat", [], messages=messages))

    def has_chat_template(self) -> bool:
        return bool(getattr(self.lm.tokenizer, "chat_template", None))

    def ids_of(self, tokens: list[Token]) -> tuple[list[int], int | None]:
        """(ids of the tokens up to the first one no token of this tokenizer has the bytes of,
        the index of that one or None)."""
        out = []
        for i, tok in enumerate(tokens):
            token_id = self.vocab.id_of(tok)
            if token_id is None:
                return out, i
            out.append(token_id)
        return out, None

    def id_of(self, token: Token) -> int | None:
        return self.vocab.id_of(token)

    def bytes_of(self, token_id: int) -> bytes:
        return self.token_bytes(token_id)

    def text_of(self, token_id: int) -> str:
        return self.token_bytes.text(token_id)

    def forced(self, prompt: list[int], ids: list[int]) -> Forced:
        key = (tuple(prompt), tuple(ids))
        if key not in self._forced:
            seq = torch.tensor([prompt + ids], device=self.lm.model.device)  # (1, len)
            with torch.inference_mode():
                logits = self.lm.model(input_ids=seq, use_cache=False).logits[0, :-1].float().cpu()
            if len(self._forced) >= KEEP:  # each holds two (len, vocab) float32 tensors
                self._forced.pop(next(iter(self._forced)))
            self._forced[key] = Forced(list(prompt), list(ids), logits, torch.log_softmax(logits, -1))
        return self._forced[key]
