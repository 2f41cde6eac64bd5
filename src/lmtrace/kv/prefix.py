"""The prefix cache: prompts' KV and teacher-forced numbers kept by their token ids, so that a
prompt whose beginning was computed before computes only the rest (vLLM's automatic prefix
caching, SGLang's RadixAttention; here a trie over token ids).

A prompt that shares its first m tokens with a cached one reuses the KV of its first m - 1
tokens and the numbers of targets 1..m-1: the distribution that predicts token t depends on
tokens 0..t-1 only, all shared. Token m - 1 is computed again, because its distribution
predicts token m, where the two prompts part. So a prompt never gets another prompt's number
for a token where they differ, nor for the token after; what it reuses is what it would have
computed itself (within float noise: the reused KV came from another padded forward). Where the
cached prompt is the whole beginning (m is its length) the entry's own last distribution serves
target m too, and all m tokens are reused; a prompt asked again is answered from the cache alone,
the same numbers to the bit.

Entries are bounded in bytes (their KV tensors plus an estimate of the numbers), the least
recently used out first; an entry larger than the bound is not kept. Everything is forgotten
when the model's weights change: a parameter replaced, moved, or modified in place through
torch (its version counter); writes through `.data`, which torch does not count, need `clear()`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from lmtrace.logits.measure import Forced, targets

NUMBER_BYTES = 40  # a Python float or int in a list, for the estimate of an entry's numbers
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values (1, kv_heads, len, head_dim)


@dataclass
class Entry:
    """A cached prompt: its KV, and the numbers of its targets 1..len-1 (None: not measured)."""

    ids: tuple[int, ...]
    kv: KV
    numbers: Forced | None
    top_n: int
    last: torch.Tensor  # (vocab,) float32: the distribution after the whole prompt
    nbytes: int = 0

    def serves(self, top_n: int | None) -> bool:
        """Whether its numbers serve a prompt that wants `top_n` alternatives (None: none wanted)."""
        return top_n is None or (self.numbers is not None and self.top_n >= top_n)


@dataclass
class Hit:
    """What a prompt reuses: the KV of its first `reuse` tokens and the numbers of targets
    1..reuse (those tokens' successors inside the shared part; target `reuse` from the entry's
    last distribution when the entry is the prompt's whole beginning)."""

    entry: Entry
    reuse: int

    def kv(self) -> KV:
        return [(k[:, :, : self.reuse], v[:, :, : self.reuse]) for k, v in self.entry.kv]

    def numbers(self, ids: Sequence[int], top_n: int, start: int = 1) -> Forced:
        """Targets start..min(reuse, len(ids) - 1) of the prompt `ids`, `top_n` alternatives each."""
        n, a = self.entry.numbers, start - 1
        assert n is not None
        b = min(self.reuse, len(self.entry.ids) - 1)
        out = Forced(
            logprob=n.logprob[a:b],
            rank=n.rank[a:b],
            entropy=n.entropy[a:b],
            top_ids=[t[:top_n] for t in n.top_ids[a:b]],
            top_logprobs=[t[:top_n] for t in n.top_logprobs[a:b]],
        )
        if self.reuse == len(self.entry.ids) < len(ids) and start <= self.reuse:
            out.extend(targets(self.entry.last[None], torch.tensor([ids[self.reuse]]), top_n))
        return out


class _Node:
    __slots__ = ("children", "end", "keys")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.keys: set[tuple[int, ...]] = set()  # the entries whose ids pass through this node
        self.end: tuple[int, ...] | None = None  # the entry whose ids end here


@dataclass
class Stats:
    """Counts since the cache was made: prompt tokens looked up and served from the cache."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    skipped: int = 0  # entries larger than the whole bound, not kept
    cleared: int = 0  # times the weights changed
    peak_bytes: int = 0


def weights_version(model: Any) -> tuple:
    """Changes when a parameter or buffer is replaced, moved, or modified in place."""
    tensors = [*model.parameters(), *model.buffers()]
    return tuple((t.data_ptr(), t._version) for t in tensors)


class PrefixCache:
    """Prompts' KV and numbers by token ids, at most `max_bytes` in all."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = Stats()
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recently used first
        self._root = _Node()
        self._weights: tuple | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def check_weights(self, model: Any) -> None:
        """Forgets everything when the model's weights changed since the last call."""
        version = weights_version(model)
        if self._weights is not None and version != self._weights and self._entries:
            self.clear()
            self.stats.cleared += 1
        self._weights = version

    def clear(self) -> None:
        self._entries.clear()
        self._root = _Node()
        self.bytes = 0

    def lookup(self, ids: Sequence[int], top_n: int | None = None, count: bool = True) -> Hit | None:
        """The cached prompt sharing the longest beginning with `ids` whose numbers serve
        `top_n`, as a Hit (None when no usable token is shared)."""
        path = [self._root]
        node = self._root
        for token in ids:
            node = node.children.get(token)
            if node is None:
                break
            path.append(node)
        hit = None
        for depth in range(len(path) - 1, 0, -1):  # deepest first
            node = path[depth]
            whole = node.end  # a cached prompt that is this whole beginning serves all of it
            others = (k for k in node.keys if k != whole) if depth > 1 else ()
            key = next((k for k in chain((whole,) if whole else (), others) if self._entries[k].serves(top_n)), None)
            if key is not None:
                self._entries.move_to_end(key)
                hit = Hit(self._entries[key], depth if key == whole else depth - 1)
                break
        if count:
            self.stats.lookups += 1
            self.stats.queried_tokens += len(ids)
            if hit is not None:
                self.stats.hits += 1
                self.stats.hit_tokens += hit.reuse
        return hit

    def count(self, queried: int, reused: int) -> None:
        """Counts a prompt of `queried` tokens of which `reused` were not computed again (taken
        from the cache, or from another prompt of the same forward)."""
        self.stats.lookups += 1
        self.stats.queried_tokens += queried
        if reused:
            self.stats.hits += 1
            self.stats.hit_tokens += reused

    def insert(self, ids: Sequence[int], kv: KV, numbers: Forced | None, top_n: int, last: torch.Tensor) -> bool:
        """Keeps a computed prompt (KV of every token; numbers of targets 1..len-1; `last` the
        distribution after it); False when it is larger than the whole bound. Evicts the least
        recently used until it fits."""
        key = tuple(ids)
        old = self._entries.get(key)
        if old is not None and (old.serves(top_n if numbers is not None else None)):
            self._entries.move_to_end(key)
            return True
        entry = Entry(key, kv, numbers, top_n, last)
        tensors = [t for pair in kv for t in pair] + [last]
        entry.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if numbers is not None:
            entry.nbytes += len(numbers.logprob) * (3 + 2 * top_n) * NUMBER_BYTES
        if entry.nbytes > self.max_bytes:
            self.stats.skipped += 1
            return False
        if old is not None:
            self._remove(key)
        while self._entries and self.bytes + entry.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1
        self._entries[key] = entry
        self.bytes += entry.nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)
        node = self._root
        node.keys.add(key)
        for token in key:
            node = node.children.setdefault(token, _Node())
            node.keys.add(key)
        node.end = key
        return True

    def _remove(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        node = self._root
        node.keys.discard(key)
        for token in key:
            child = node.children[token]
            child.keys.discard(key)
            if not child.keys:  # no other entry below: the whole branch goes
                del node.children[token]
                return
            node = child
        node.end = None
