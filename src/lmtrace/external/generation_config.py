"""What lmtrace can tell of a `model.generate` run from the outside: its settings (from the
GenerationConfig or the keyword arguments the caller passed, never guessed), its end-of-sequence
and pad ids, and the model's header when the model is at hand."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.model.arch import summarize
from lmtrace.model.lm import model_name, model_record

# what transformers' generate uses when neither the call nor the model's generation_config sets a
# value (GenerationConfig._get_default_generation_params in transformers 5)
DEFAULTS = {"do_sample": False, "num_beams": 1, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
            "repetition_penalty": 1.0}  # fmt: skip


def settings_dict(config: Any) -> dict[str, Any]:
    """A GenerationConfig, or the dict of keyword arguments given to generate, as a plain dict."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return {k: v for k, v in to_dict().items() if v is not None}
    raise InvalidParameter(
        f"generation_config must be a transformers GenerationConfig or a dict of generate's arguments, "
        f"got {type(config).__name__}"
    )


def params_of(config: Any, generated: int, top_logprobs: int) -> dict[str, Any]:
    """The run's settings in lmtrace's words (SamplingParams' fields) where they are known. Without
    a config only what the output itself shows is recorded, and `settings: "unknown"` says so."""
    given = settings_dict(config)
    if not given:
        return {"max_new_tokens": generated, "top_logprobs": top_logprobs, "settings": "unknown"}
    s = {**DEFAULTS, **given}
    greedy = not s["do_sample"]
    params: dict[str, Any] = {
        "max_new_tokens": given.get("max_new_tokens", generated),
        "temperature": 0.0 if greedy else float(s["temperature"]),
        "top_k": 0 if greedy or not s["top_k"] else int(s["top_k"]),
        "top_p": 1.0 if greedy or s["top_p"] is None else float(s["top_p"]),
        "min_p": 0.0 if greedy or not s["min_p"] else float(s["min_p"]),
        "repetition_penalty": float(s["repetition_penalty"] or 1.0),
        "seed": None,
        "stop": [],
        "top_logprobs": top_logprobs,
        "stop_on_eos": True,
    }
    if int(s["num_beams"] or 1) > 1:
        params["num_beams"] = int(s["num_beams"])
    return params


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(x) for x in value.flatten().tolist()]
    return [int(value)] if isinstance(value, int) else [int(x) for x in value]


def special_ids(tokenizer: Any, config: Any, model: Any) -> tuple[set[int], int | None]:
    """End-of-sequence ids (the call's, the model's generation_config's and the tokenizer's) and
    the pad id, which generate writes after a row's end and before a left-padded prompt."""
    given = settings_dict(config)
    model_gen = getattr(model, "generation_config", None)
    eos: set[int] = set(_ids(given.get("eos_token_id")))
    eos |= set(_ids(getattr(model_gen, "eos_token_id", None)))
    eos |= set(_ids(getattr(tokenizer, "eos_token_id", None)))
    pad = given.get("pad_token_id")
    for source in (model_gen, tokenizer):
        if pad is None:
            pad = getattr(source, "pad_token_id", None)
    if pad is None and eos:  # generate falls back on the end token
        pad = min(eos) if len(eos) > 1 else next(iter(eos))
    return eos, None if pad is None else int(_ids(pad)[0])


def model_header(model: Any, tokenizer: Any, dists: torch.Tensor) -> dict[str, Any]:
    """The trace's `model` dict: the full summary with the model, else what the output shows."""
    if model is not None:
        return model_record(model_name(model), summarize(model.config, model).to_dict())
    source = model_name(tokenizer) if getattr(tokenizer, "name_or_path", "") else "model.generate"
    return {"source": source, "config": {}, "dtype": None, "device": str(dists.device)}
