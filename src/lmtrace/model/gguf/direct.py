"""A packed load straight from the GGUF file, without the float32 copy: the model is built empty
from its config (transformers' `no_init_weights`: no random init, its weights allocated but never
written, so never resident), every linear layer of a packed type is replaced by its PackedLinear
read from the file's blocks (model/gguf/packed.py), and only what stays float (norms, embeddings,
biases, linear layers of unpacked types) is dequantized by gguf and put in place, through
transformers' own tensor processor for the architecture (Gemma's norms, Llama's row order).
A parameter the file does not fill makes the load fail (ValueError), never a model with
uninitialized weights."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmtrace.model.gguf.packed import pack_gguf
from lmtrace.model.gguf.report import PackReport
from lmtrace.model.gguf.tensors import GGUFTensors

CHUNK_ROWS = 16384  # rows of a large float tensor dequantized at a time


def _put(param: torch.Tensor, value: np.ndarray, name: str) -> None:
    with warnings.catch_warnings():  # a read-only view of the mapped file: it is only read
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    if tensor.numel() != param.numel():
        raise ValueError(f"{name}: GGUF tensor of {tensor.numel()} values for {param.numel()}")
    param.copy_(tensor.reshape(param.shape))


def _in_chunks(t: Any, param: torch.Tensor, processor: Any, to_hf: dict[str, str]) -> bool:
    """Dequantizes a large 2-D tensor into `param` CHUNK_ROWS rows at a time (no whole float32
    temporary) when transformers' processor leaves its rows as they are; False otherwise."""
    from gguf.quants import dequantize

    rows = t.data.shape[0] if t.data.ndim == 2 else 0
    if rows <= CHUNK_ROWS or param.dim() != 2 or param.shape[0] != rows:
        return False
    head = dequantize(t.data[:2], t.tensor_type)
    result = processor.process(
        weights=head.copy(), name=t.name, tensor_key_mapping=to_hf, parsed_parameters={"tensors": {}}
    )
    if result.name is None or result.weights.shape != head.shape or not np.array_equal(result.weights, head):
        return False
    for i in range(0, rows, CHUNK_ROWS):
        _put(param[i : i + CHUNK_ROWS], dequantize(t.data[i : i + CHUNK_ROWS], t.tensor_type), t.name)
    return True


def fill_float(model: nn.Module, reader: Any, report: PackReport | None = None) -> int:
    """Puts the file's float tensors, dequantized as transformers' loader makes them, into every
    parameter still held in float, one tensor at a time; returns their bytes. The input
    embedding is first replaced by a PackedEmbedding where it can be (model/gguf/embedding.py;
    `report.embedding` says which). Raises ValueError naming a parameter the file does not hold."""
    from gguf.quants import dequantize

    from lmtrace.model.gguf.embedding import pack_embedding
    from lmtrace.model.gguf.names import file_architecture, processor_for, weights_map

    arch = file_architecture(reader)
    processor = processor_for(model, arch)
    to_hf = weights_map(model, processor, arch)
    why = pack_embedding(model, reader, processor, to_hf)
    if report is not None:
        embed = model.get_input_embeddings()
        report.embedding = f"{embed.kind}, rows dequantized when looked up" if not why else f"float ({why})"
    params, filled = dict(model.named_parameters()), set()
    with torch.no_grad():
        for t in reader.tensors:
            hf = to_hf.get(t.name)
            if hf not in params or hf in filled:
                continue
            if not _in_chunks(t, params[hf], processor, to_hf):
                parsed: dict[str, Any] = {"tensors": {}}
                result = processor.process(
                    weights=dequantize(t.data, t.tensor_type),
                    name=t.name,
                    tensor_key_mapping=to_hf,
                    parsed_parameters=parsed,
                )
                stored = parsed["tensors"] if result.name is None else {hf: result.weights}  # experts, GPT-2's head
                for name, value in stored.items():
                    if name in params:
                        _put(params[name], value.numpy() if isinstance(value, torch.Tensor) else value, name)
                        filled.add(name)
            filled.add(hf)
            release = getattr(reader, "release", None)
            if release is not None:  # its pages read: out of this process's resident memory
                release(t)
    missing = [n for n in params if n not in filled]
    if missing:
        raise ValueError(f"no GGUF tensor for {missing[0]}")
    return sum(p.numel() * p.element_size() for p in params.values())


def load_packed(config: Any, path: str | Path, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """The model of `config` with its linear layers packed from the GGUF at `path` and the rest
    dequantized from it; no float32 copy of the packed layers is ever made."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # transformers ties in init_weights, which no_init_weights skips
    model.eval()
    reader = GGUFTensors(path)

    def fill(m: nn.Module, report: PackReport) -> None:
        report.float_bytes = fill_float(m, reader, report)

    pack_gguf(model, path, compute_dtype, check=False, before_fuse=fill)
    return model
