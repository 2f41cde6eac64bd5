"""A summary of a causal LM's architecture, read from its config (and the model when loaded)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ArchSummary:
    architecture: str
    model_type: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int | None
    attention: str  # "MHA", "GQA (group size N)" or "MQA"
    dtype: str | None = None
    device: str | None = None
    parameters: int | None = None
    # how the linear layers' weights are held where not plain `dtype` tensors: e.g.
    # "packed 4-bit (Q4_1 x210, Q8_0 x1), float32 activations" (lmtrace.model.gguf.packed)
    weights: str | None = None
    # the layers that attend over a sliding window, where some do: "15 of 18 layers, window 512"
    sliding: str | None = None
    # the kernel of the float32 linear layers where not torch's own:
    # "onednn (211 linear layers, 60 groups, 30 decoder layers in one function, 30 with RMSNorm and
    # rotary in C (torch's bits))"
    # (lmtrace.model.matmul); left out of the dict where None, so default traces keep their shape
    matmul: str | None = None
    # true where the model runs the batch-invariant operations (lmtrace.model.invariant); left out
    # of the dict otherwise
    batch_invariant: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("matmul", "batch_invariant"):
            if d[name] is None:
                del d[name]
        return d


def text_config(config: Any) -> Any:
    """Multimodal configs keep the language model's numbers in a sub-config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def attention_kind(heads: int, kv_heads: int) -> str:
    if kv_heads == heads:
        return "MHA"
    if kv_heads == 1:
        return "MQA"
    return f"GQA (group size {heads // kv_heads})"


def summarize(config: Any, model: Any = None) -> ArchSummary:
    c = text_config(config)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    archs = getattr(config, "architectures", None) or []
    dtype = device = params = None
    if model is not None:
        archs = archs or [type(model).__name__]
        first = next(model.parameters())
        dtype, device = str(first.dtype).replace("torch.", ""), str(first.device)
        params = sum(p.numel() for p in model.parameters())
        params += sum(getattr(m, "packed_numel", 0) for m in model.modules())  # packed layers hold buffers
    return ArchSummary(
        architecture=archs[0] if archs else config.model_type,
        model_type=config.model_type,
        layers=int(c.num_hidden_layers),
        attention_heads=heads,
        kv_heads=kv_heads,
        head_dim=int(head_dim),
        hidden_size=int(c.hidden_size),
        vocab_size=int(c.vocab_size),
        context_length=getattr(c, "max_position_embeddings", None),
        attention=attention_kind(heads, kv_heads),
        dtype=dtype,
        device=device,
        parameters=params,
        weights=_weights(model),
        sliding=sliding_summary(c),
        matmul=getattr(model, "lmtrace_matmul", None) if model is not None else None,
        batch_invariant=True if getattr(model, "lmtrace_batch_invariant", None) is not None else None,
    )


def sliding_summary(c: Any) -> str | None:
    """'15 of 18 layers, window 512' from `layer_types` and `sliding_window`; None where no layer slides."""
    types = list(getattr(c, "layer_types", None) or [])
    window = getattr(c, "sliding_window", None)
    sliding = sum(t in ("sliding_attention", "chunked_attention") for t in types)
    if not sliding or not window:
        return None
    return f"{sliding} of {len(types)} layers, window {window}"


def _weights(model: Any) -> str | None:
    report = getattr(model, "lmtrace_packed", None) if model is not None else None
    return report.short() if report is not None else None
