"""A loaded model as lmtrace hands it around: the transformers model, its tokenizer, and what
lmtrace needs to know of them (source, architecture summary, end and pad tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmtrace.model.arch import ArchSummary, summarize


@dataclass
class LM:
    """A loaded model: `.model` (transformers), `.tokenizer`, and what lmtrace needs to know."""

    model: Any
    tokenizer: Any
    source: str
    summary: ArchSummary
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    # lmtrace.load's seconds: {"imports_s": torch/transformers/the model's class, "weights_s": the rest}
    load_timing: dict[str, float] = field(default_factory=dict)
    # draft models for speculative decoding, loaded once per spec (lmtrace.model.draft)
    drafts: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_objects(cls, model: Any, tokenizer: Any, source: str | None = None) -> LM:
        """Wraps a model and tokenizer the caller already has; `source` names it in traces
        (default: the model's own name, model_name)."""
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = tokenizer.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(gen, "pad_token_id", None) if gen is not None else None
        pad = pad if pad is not None else tokenizer.pad_token_id
        pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
        model.eval()
        name = source if source is not None else model_name(model)
        return cls(model, tokenizer, name, summarize(model.config, model), eos_ids, int(pad))

    def record(self) -> dict[str, Any]:
        """The `model` entry of the records made with it (traces, scores): see `model_record`."""
        return model_record(self.source, self.summary.to_dict())


def model_record(source: str, summary: dict[str, Any]) -> dict[str, Any]:
    """A record's `model` entry: its source, the architecture summary, its dtype and device."""
    return {"source": source, "config": summary, "dtype": summary["dtype"], "device": summary["device"]}


def model_name(model: Any) -> str:
    """A model's name for titles and headers: its `name_or_path`, except for lmtrace's converted
    copy of a GGUF file (a sha256-named folder in the cache), which is named by the file."""
    name = str(getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    if not name:
        return "in-memory"
    from lmtrace.model.gguf.converted import source_of

    source = source_of(name)
    return source if source is not None else name


def require_chat_template(lm: LM, option: str = "chat (--chat)", instead: str = "leave out --chat") -> None:
    """Raises InvalidParameter, one line naming `option` and the model, when its tokenizer has
    no chat template (transformers' own error is a multi-line ValueError)."""
    if not getattr(lm.tokenizer, "chat_template", None):
        from lmtrace.errors import InvalidParameter

        raise InvalidParameter(f"{option}: {lm.source} has no chat template; {instead}")
