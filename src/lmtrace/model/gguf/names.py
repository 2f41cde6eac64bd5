"""Which GGUF tensor holds each linear layer of a model transformers loaded from that file, and in
which row order: transformers' own map (`get_gguf_hf_weights_map`, the one its loader uses, with
its aliases: `gemma3_text` -> `gemma3`, `qwen2_moe` -> `qwen2moe`, `cohere` -> `command-r`, …)
and its own tensor processor for the file's architecture, run on row numbers to learn the order
it gives the rows (Llama's q/k are un-permuted, Bloom's fused qkv regrouped by head)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass
class Found:
    """One linear layer's GGUF tensor."""

    tensor: Any  # gguf.ReaderTensor
    order: torch.Tensor | None  # the tensor's rows in the module's order; None: as stored
    note: str = ""  # why it cannot be packed (empty: it can)


def file_architecture(reader: Any) -> str | None:
    """The `general.architecture` a GGUF file declares (e.g. "gemma3", "llama"); `reader` a
    GGUFTensors (model/gguf/tensors.py) or gguf's GGUFReader."""
    if hasattr(reader, "architecture"):
        return reader.architecture
    field = reader.fields.get("general.architecture")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def processor_for(model: nn.Module, arch: str | None) -> Any:
    from transformers import modeling_gguf_pytorch_utils as hf

    config = model.config.get_text_config().to_dict() if hasattr(model.config, "get_text_config") else {}
    return hf.TENSOR_PROCESSORS.get(arch or "", hf.TensorProcessor)(config=config)


_SWAP = threading.Lock()


@contextlib.contextmanager
def _name_maps_built_once() -> Iterator[None]:
    """transformers' get_gguf_hf_weights_map recurses into every submodule and asks gguf for its
    TensorNameMap again in each (397 times for SmolLM2-135M: ~5-9 s of a packed load, twice); it is
    the same map for the same architecture and layer count. transformers imports the function from
    gguf at each call, so gguf's is swapped, for this call, for one that builds each map once."""
    import gguf

    with _SWAP:
        built = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.cache(built)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = built


def weights_map(model: nn.Module, processor: Any, arch: str | None) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, as transformers' loader maps them."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with _name_maps_built_once():
        try:
            return get_gguf_hf_weights_map(model, processor)
        except NotImplementedError:  # a model_type gguf does not know: the file's own architecture
            if arch is None:
                return {}
            return get_gguf_hf_weights_map(model, processor, model_type=arch)


def _row_order(processor: Any, name: str, out_features: int, in_features: int) -> tuple[torch.Tensor | None, str]:
    """(the row order transformers' processor gives this tensor, or None for as stored; a reason
    when it does more than reorder rows)."""
    if type(processor).process is _base_process() or out_features == 1:  # one row has one order
        return None, ""
    for shape in ((out_features, 1), (out_features, in_features)):
        rows = np.broadcast_to(np.arange(out_features, dtype=np.int64)[:, None], shape).copy()
        try:
            kwargs = {"tensor_key_mapping": {}, "parsed_parameters": {"tensors": {}}}
            result = processor.process(weights=rows, name=name, **kwargs)
        except (ValueError, KeyError, TypeError):
            continue
        got = getattr(result, "weights", None)
        if got is None or got.shape != rows.shape or not (got == got[:, :1]).all():
            return None, "transformers rearranges this tensor beyond its rows"
        order = got[:, 0]
        if (order == np.arange(out_features)).all():
            return None, ""
        return torch.from_numpy(order.copy()), ""
    return None, "transformers' tensor processor could not be traced on this tensor"


def _base_process() -> Any:
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    return TensorProcessor.process


def linear_tensors(model: nn.Module, reader: Any) -> tuple[dict[str, Found], str | None]:
    """({linear module name: its GGUF tensor}, the file's architecture). A tied lm_head maps to
    the embedding's tensor."""
    arch = file_architecture(reader)
    processor = processor_for(model, arch)
    to_hf = weights_map(model, processor, arch)
    by_param = {hf: gguf_name for gguf_name, hf in to_hf.items()}
    tensors = {t.name: t for t in reader.tensors}
    embed = model.get_input_embeddings()
    embed_name = next((n for n, m in model.named_modules() if m is embed), None)
    found: dict[str, Found] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        gguf_name = by_param.get(f"{name}.weight")
        if gguf_name not in tensors and embed_name and module.weight is embed.weight:
            gguf_name = by_param.get(f"{embed_name}.weight")
        if gguf_name not in tensors:
            continue
        order, note = _row_order(processor, gguf_name, module.out_features, module.in_features)
        found[name] = Found(tensors[gguf_name], order, note)
    return found, arch
