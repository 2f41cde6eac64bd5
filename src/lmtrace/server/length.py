"""Whether a prompt fits the model's context: by its tokens (`check_fits`), and first by its
length alone (`check_length`), so that a prompt far beyond the context (a 5 MB paste) is refused
at once instead of after seconds of tokenizing it. The bound is exact, never a guess: where every
character of the text is covered by some token and no token covers more characters than its
own string has (a byte-level or metaspace BPE with no normalizer, no added token that swallows
the spaces beside it, no fused unknown token), a text of C characters has at least
C / (the longest token string) tokens. Another tokenizer has no bound: its prompts are
tokenized in full, as before."""

from __future__ import annotations

import json
import weakref
from typing import Any

from lmtrace.model.lm import LM
from lmtrace.server.errors import bad_request

# pre-tokenizers that keep every character (the ones that split on whitespace drop it)
_KEEPING = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"}
_LONGEST: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def context_size(lm: LM) -> int | None:
    return getattr(lm.model.config, "max_position_embeddings", None)


def _keeps_every_character(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") not in _KEEPING or pre.get("behavior") == "Removed":
        return False
    return all(_keeps_every_character(p) for p in pre.get("pretokenizers", []))


def _longest(tok: Any) -> int | None:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: no bound
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    if spec.get("normalizer") is not None or not _keeps_every_character(spec.get("pre_tokenizer")):
        return None
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in added) or not isinstance(model.get("vocab"), dict):
        return None
    return max(len(s) for s in [*model["vocab"], *(t["content"] for t in added)])


def longest_token(tok: Any) -> int | None:
    """The most characters one token of `tok` can cover (its longest token string), or None
    where the tokenizer gives no such bound; computed once per tokenizer."""
    try:
        return _LONGEST[tok]
    except (KeyError, TypeError):
        pass
    longest = _longest(tok)
    try:
        _LONGEST[tok] = longest
    except TypeError:  # a tokenizer that takes no weak reference is asked again next time
        pass
    return longest


def check_length(lm: LM, text: str, max_tokens: int, name: str = "prompt", param: str = "prompt") -> None:
    """Refuses, before tokenizing, a text whose length alone proves that it leaves no room for
    `max_tokens` (check_fits' words for the prompt, the count given as the bound); a text the
    bound cannot decide is left to check_fits after tokenizing."""
    limit, longest = context_size(lm), longest_token(lm.tokenizer)
    if not limit or not longest:
        return
    least = -(-len(text) // longest)  # ceil: no token covers more than `longest` characters
    if least + max_tokens <= limit or not (least >= limit or least > max_tokens):
        return
    raise bad_request(
        f"{name} is too long: it has {len(text)} characters, so at least {least} tokens (no token of this model "
        f"is longer than {longest} characters), and the model's context holds {limit} tokens; "
        f"with max_tokens {max_tokens} the prompt may have at most {max(0, limit - max_tokens)}",
        param,
    )


def check_fits(lm: LM, ids: list[int], max_tokens: int, name: str = "prompt", param: str = "prompt") -> None:
    """The prompt and `max_tokens` fit the model's context. A prompt that leaves no room for
    `max_tokens` is blamed on the prompt (its tokens, the limit, what max_tokens leaves it); a
    prompt that fits, on max_tokens (what this prompt leaves it)."""
    limit = context_size(lm)
    if not limit or len(ids) + max_tokens <= limit:
        return
    if len(ids) >= limit or len(ids) > max_tokens:  # the prompt is the larger part
        room = max(0, limit - max_tokens)
        raise bad_request(
            f"{name} is too long: it has {len(ids)} tokens and the model's context holds {limit} tokens; "
            f"with max_tokens {max_tokens} the prompt may have at most {room}",
            param,
        )
    raise bad_request(
        f"max_tokens is too large: the {name} has {len(ids)} tokens and max_tokens is {max_tokens}, "
        f"{len(ids) + max_tokens} in all, but the model's context holds {limit} tokens "
        f"(max_tokens {limit - len(ids)} at most with this {name})",
        "max_tokens",
    )
