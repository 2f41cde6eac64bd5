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


def _float_tensors(model: nn.Module, reader: Any) -> dict[str, np.ndarray]:
    """{parameter name: float32 array} for the GGUF tensors that map onto the model's parameters
    still held in float, as transformers' loader would make them."""
    from gguf.quants import dequantize

    from lmtrace.model.gguf.names import file_architecture, processor_for, weights_map

    arch = file_architecture(reader)
    processor = processor_for(model, arch)
    to_hf = weights_map(model, processor, arch)
    wanted = dict(model.named_parameters())
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        hf = to_hf.get(t.name)
        if hf not in wanted or hf in out:
            continue
        weights = dequantize(t.data, t.tensor_type)
        parsed: dict[str, Any] = {"tensors": {}}
        result = processor.process(weights=weights, name=t.name, tensor_key_mapping=to_hf, parsed_parameters=parsed)
        if result.name is None:  # the processor stored it itself (experts, GPT-2's head)
            for name, tensor in parsed["tensors"].items():
                out[name] = tensor.numpy() if isinstance(tensor, torch.Tensor) else tensor
            continue
        out[hf] = result.weights
    return out


def fill_float(model: nn.Module, reader: Any) -> int:
    """Puts the file's float tensors into every parameter still held in float; returns their bytes.
    Raises ValueError naming a parameter the file does not hold."""
    arrays = _float_tensors(model, reader)
    total = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in arrays:
                raise ValueError(f"no GGUF tensor for {name}")
            with warnings.catch_warnings():  # a read-only view of the mapped file: it is only read
                warnings.simplefilter("ignore", UserWarning)
                value = torch.from_numpy(np.ascontiguousarray(arrays[name], dtype=np.float32))
            if value.numel() != param.numel():
                raise ValueError(f"{name}: GGUF tensor of {value.numel()} values for {param.numel()}")
            param.copy_(value.reshape(param.shape))
            total += param.numel() * param.element_size()
    return total


def load_packed(config: Any, path: str | Path, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model of `config` with its linear layers packed from the GGUF at `path` and the rest
    dequantized from it; no float32 copy of the packed layers is ever made."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # transformers ties in init_weights, which no_init_weights skips
    model.eval()
    reader = gguf.GGUFReader(str(path))

    def fill(m: nn.Module, report: PackReport) -> None:
        report.float_bytes = fill_float(m, reader)

    pack_gguf(model, path, compute_dtype, check=False, before_fuse=fill)
    return model
