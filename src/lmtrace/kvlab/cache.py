"""The lab's one reader and writer of cache internals (beside kv.py): the absolute position
held in every slot of every layer, eviction by slot index, and bytes measured on the tensors.

Eviction keeps the slots' order, so a layer's keys stay sorted by position; position ids stay
absolute (the new token is always fed at its original position), and transformers builds the
causal mask from the kept length (`get_seq_length()` is `keys.shape[-2]` for a DynamicLayer),
which lets a one-token query see every kept slot."""

from __future__ import annotations

from typing import Any

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.kv import ledger


class LabCache:
    """A transformers cache plus, per layer, the absolute positions of its slots."""

    def __init__(self, cache: Any, evicting: bool, rope: Any = None):
        self.cache = cache
        self.evicting = evicting
        self.positions: list[torch.Tensor] = []  # per layer: (slots,) long, ascending
        # with re-rotation (StreamingLLM's positions within the cache): the model's rotary
        # embedding, and per layer the position each slot's key is rotated to now
        self.rope = rope
        self.rotary: list[torch.Tensor] = []

    @property
    def layers(self) -> list[Any]:
        return list(self.cache.layers)

    def appended(self, start: int, count: int) -> None:
        """Records that the last forward appended positions start .. start+count-1 to every layer
        (a sliding layer drops its oldest itself; its slots are read from its length)."""
        new = torch.arange(start, start + count)
        if not self.positions:
            self.positions = [torch.empty(0, dtype=torch.long) for _ in self.cache.layers]
        for i, layer in enumerate(self.cache.layers):
            held = torch.cat([self.positions[i], new])
            self.positions[i] = held[held.numel() - self.slots(layer) :] if self.slots(layer) else held[:0]
        if self.rope is not None:
            fed = torch.arange(self.next_position(start), self.next_position(start) + count)
            if not self.rotary:
                self.rotary = [torch.empty(0, dtype=torch.long) for _ in self.cache.layers]
            self.rotary = [torch.cat([r, fed]) for r in self.rotary]

    def next_position(self, absolute: int) -> int:
        """The position id the next token is fed at: its absolute position, or with re-rotation
        the number of slots the cache holds (every full-attention layer holds as many)."""
        if self.rope is None or not self.rotary:
            return absolute
        return int(self.rotary[0].numel())

    def rerotate(self) -> None:
        """Rotates every kept key from the position it was rotated to onto its slot index:
        RoPE rotations compose, so rotating by (slot - rotated) gives the key at the slot."""
        from transformers.models.llama.modeling_llama import rotate_half

        for i, layer in enumerate(self.cache.layers):
            target = torch.arange(self.positions[i].numel())
            delta = target - self.rotary[i]
            if bool((delta == 0).all()):
                continue
            keys = layer.keys  # (b, h, slots, d), rotated to self.rotary[i]
            cos, sin = self.rope(keys, delta[None].to(keys.device))  # (1, slots, d) each
            layer.keys = keys * cos[:, None] + rotate_half(keys) * sin[:, None]
            self.rotary[i] = target

    @staticmethod
    def slots(layer: Any) -> int:
        """Slots a layer holds: its key tensor's length, or its count for a quantized layer."""
        if ledger.quantized_storage(layer)[0] is not None:
            return int(layer.get_seq_length())
        keys = getattr(layer, "keys", None)
        return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0

    def sliding(self, index: int) -> bool:
        return bool(getattr(self.cache.layers[index], "is_sliding", False))

    def keys(self, index: int) -> torch.Tensor:
        """(batch, kv_heads, slots, head_dim) keys of a full-precision layer."""
        return self.cache.layers[index].keys

    def keep(self, index: int, slots: torch.Tensor) -> None:
        """Keeps only `slots` (ascending slot indices) of layer `index`, keys and values alike."""
        layer = self.cache.layers[index]
        if ledger.quantized_storage(layer)[0] is not None or self.sliding(index):
            raise InvalidParameter("policy: eviction works on full-precision full-attention layers only")
        slots = slots.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, slots)  # (b, h, kept, d)
        layer.values = layer.values.index_select(-2, slots)
        self.positions[index] = self.positions[index][slots.cpu()]
        if self.rotary:
            self.rotary[index] = self.rotary[index][slots.cpu()]

    def kept(self) -> list[list[int]]:
        """Absolute positions held per layer."""
        return [p.tolist() for p in self.positions]

    def measured_bytes(self) -> int:
        return ledger.state(self.cache, layers=False).bytes

    def formula_bytes(self, formula: Any) -> int:
        """What `formula(layer_index, slots, residual)` says for the slots every layer holds now
        (`residual`: slots a quantized layer still keeps in full precision)."""
        total = 0
        for i, layer in enumerate(self.cache.layers):
            quantized = ledger.quantized_storage(layer)[0] is not None
            keys = getattr(layer, "keys", None)
            residual = int(keys.shape[-2]) if quantized and isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
            total += formula(i, self.slots(layer), residual)
        return total
