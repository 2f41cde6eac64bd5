"""The input embedding of a packed load, read from the GGUF's own blocks: the token-embedding
tensor stays in the memory-mapped file (a Gemma 3 270M's 262,144 x 640 table: 178 MB of Q8_0
there, 671 MB as float32), and each forward dequantizes, with gguf's own `dequantize`, only the
rows of the ids it is given, then runs the model's own embedding forward on them (Gemma's
scaling by sqrt(hidden) included), so its output equals the float32 model's bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


class PackedEmbedding(nn.Module):
    """An embedding whose weight rows are dequantized from `raw` (one row of GGUF blocks per
    token, a view of the mapped file) when looked up. `original` is the model's embedding module
    (its forward is run on the looked-up rows; its weight is never filled)."""

    def __init__(self, original: nn.Embedding, raw: np.ndarray, kind: Any, source: str) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = original.num_embeddings, original.embedding_dim
        self.padding_idx = original.padding_idx
        self.raw, self.tensor_type, self.source = raw, kind, source  # not buffers: they stay in the file
        self.kind = kind.name
        self.packed_numel = self.num_embeddings * self.embedding_dim  # weights it stands for (arch.summarize)
        original.weight = nn.Parameter(torch.empty(0, self.embedding_dim), requires_grad=False)  # never filled
        original.padding_idx = None  # it only zeroes a gradient; F.embedding checks it against the rows given
        self.__dict__["original"] = original  # not a submodule: run for its forward alone

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(k,) token ids -> (k, dim) float32: gguf's own dequantization of those rows."""
        from gguf.quants import dequantize

        w = dequantize(np.asarray(self.raw[ids.numpy()]), self.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(len(ids), self.embedding_dim))

    # rows come from numpy on the host: torch.compile runs this lookup eagerly, between its graphs
    @torch.compiler.disable
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.detach().cpu().long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        unique, where = ids.unique(return_inverse=True)
        weight = self.rows(unique.reshape(-1)).to(input_ids.device)
        return torch.func.functional_call(self.original, {"weight": weight}, (where.to(input_ids.device),))

    def nbytes(self) -> int:
        return 0  # its blocks stay in the file

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.num_embeddings}, {self.embedding_dim} (rows dequantized when looked up)"


def pack_embedding(model: nn.Module, reader: Any, processor: Any, to_hf: dict[str, str]) -> str:
    """Replaces the model's input embedding by a PackedEmbedding over its GGUF tensor in `reader`
    (GGUFTensors) where transformers' processor leaves that tensor's rows as gguf dequantizes
    them; returns "" when it did, else why not (the embedding then stays float)."""
    from gguf.quants import dequantize

    embed = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is embed), None)
    if not isinstance(embed, nn.Embedding) or name is None or embed.max_norm is not None:
        return "not an nn.Embedding"
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and head.weight is embed.weight:
        return "tied to an lm_head kept in float"
    by_param = {hf: g for g, hf in to_hf.items()}
    tensor = next((t for t in reader.tensors if t.name == by_param.get(f"{name}.weight")), None)
    if tensor is None or tensor.data.dtype != np.uint8 or tensor.data.ndim != 2:
        return "no quantized GGUF tensor for it"
    if tensor.data.shape[0] != embed.num_embeddings:
        return f"{tensor.data.shape[0]} rows in the file for {embed.num_embeddings} tokens"
    head = dequantize(tensor.data[:2], tensor.tensor_type)
    result = processor.process(
        weights=head.copy(), name=tensor.name, tensor_key_mapping=to_hf, parsed_parameters={"tensors": {}}
    )
    if result.name is None or result.weights.shape != head.shape or not np.array_equal(result.weights, head):
        return "transformers' loader changes its rows"
    model.set_submodule(name, PackedEmbedding(embed, tensor.data, tensor.tensor_type, tensor.name))
    return ""
