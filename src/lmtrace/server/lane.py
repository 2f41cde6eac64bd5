"""The prompts of the server's requests, prefilled together on the model thread: padded forwards
grouped by length across requests, each prompt starting from its longest cached beginning
(lmtrace.decode.prefill, lmtrace.kv.prefix). One pass per prompt: the prefill that gives a
generation its first distribution also gives the echoed prompt's logprobs.

A request that needs no decode step is answered here at once: echo with `max_tokens` 0 (the
prompt scored, nothing generated) and `max_tokens` 1 (lm-evaluation-harness's scoring
requests: the one token is chosen from the prefill's distribution). The others' rows join the
running batch with the KV their prefill made (ContinuousBatch.join_prefilled).

Only the prompts of echo requests (whose prompt is scored: evaluation, perplexity; not a trace's,
which records every number as alone) share the prefix cache and each other's beginnings: their
numbers equal lone teacher forcing within float noise (on a batch-invariant model, bit for bit:
lmtrace.model.invariant.layout). A generation is computed as before any
cache, so its answer does not depend on what was asked before it.

Events a request gets from here, besides its steps: ("prompt", i, [PromptToken]) with echo and
("cached", i, tokens), how many of prompt i's tokens were not computed again (taken from the
prefix cache, or computed once for several prompts of one forward)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmtrace.decode.continuous import RowSpec, RowState, first_steps
from lmtrace.decode.prefill import Prefilled, PromptRow, prefill_many
from lmtrace.decode.tree_prefill import Ride
from lmtrace.kv import ledger
from lmtrace.kv.prefix import PrefixCache
from lmtrace.model.lm import LM
from lmtrace.server.logprobs import prompt_tokens

if TYPE_CHECKING:
    from lmtrace.server.prepare import Job

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # 1 GiB: about 23,000 tokens of the bundled model's float32 KV

Key = tuple[int, int]  # (id of the request's handle, index of its prompt)


class Lane:
    """Prefills requests' prompts; keeps the prefix cache (None when off or impossible: a
    sliding-window cache cannot take rows computed apart)."""

    def __init__(self, lm: LM, cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
        self.lm = lm
        # whether rows prefilled apart can be put together (plain full-attention layers)
        self.reuse_kv = ledger.regroupable(ledger.new_cache(lm.model))
        self.cache = PrefixCache(cache_bytes) if cache_bytes and self.reuse_kv else None

    def at_once(self, job: Job) -> bool:
        """Whether the request is answered from its prefill alone (no decode step)."""
        return not job.generate or (self.reuse_kv and job.params.max_new_tokens == 1)

    def prefill(self, wanted: Sequence[tuple[Any, int]], keep_kv: bool, ride: Ride | None = None) -> dict:
        """[(request, prompt index)] prefilled together (each prompt once); {key: Prefilled}.
        `ride`: the running batch's decode step, computed in the first forward.
        The prompts of a request with echo are measured with its number of alternatives and
        share the prefix cache; the others are computed as before any cache (a generation's
        numbers do not depend on what was asked before it)."""
        keys: dict[Key, None] = {}
        rows = []
        for req, i in wanted:
            key = (id(req.handle), i)
            if key in keys:
                continue
            job = req.job
            keys[key] = None
            top_n = (job.top_n if job.logprobs else 0) if job.echo else None
            rows.append(PromptRow(job.prompts[i].ids, top_n, share=job.echo and job.share))
        done = prefill_many(
            self.lm.model,
            rows,
            pad_id=self.lm.pad_token_id,
            cache=self.cache,
            keep_kv=keep_kv and self.reuse_kv,
            ride=ride,
        )
        return dict(zip(keys, done))

    def announce(self, req: Any, i: int, p: Prefilled) -> None:
        """Prompt i's echo and cached-token count, once per prompt of a request."""
        if i in req.announced:
            return
        req.announced.add(i)
        job = req.job
        if job.echo:
            req.handle.emit(("prompt", i, prompt_tokens(self.lm, p.ids, p.numbers)))
        req.handle.emit(("cached", i, p.cached))

    def answer(self, req: Any, found: dict[Key, Prefilled], specs: Sequence[RowSpec]) -> list[RowState]:
        """A request answered from its prefills: its echo, and with `max_tokens` 1 each
        choice's one step (the rows come back with their traces or errors)."""
        job = req.job
        for i in range(len(job.prompts)):
            self.announce(req, i, found[(id(req.handle), i)])
        if not job.generate:
            return []
        return first_steps(self.lm, specs, [found[(id(req.handle), s.tag[1] // job.n)] for s in specs])

    def metrics(self) -> dict[str, int]:
        """The prefix cache's counters (zeros when it is off)."""
        c = self.cache
        if c is None:
            return {"enabled": 0}
        s = c.stats
        return {
            "enabled": 1,
            "max_bytes": c.max_bytes,
            "bytes": c.bytes,
            "peak_bytes": s.peak_bytes,
            "entries": len(c),
            "queried_tokens": s.queried_tokens,
            "hit_tokens": s.hit_tokens,
            "lookups": s.lookups,
            "hits": s.hits,
            "evictions": s.evictions,
            "skipped": s.skipped,
            "cleared": s.cleared,
        }


def echo_alone(lm: LM, job: Job, emit: Any) -> None:
    """A request's echo on the one-at-a-time worker (and for a compiled request): its prompts
    scored together, in one padded forward where they fit, each sent as ("prompt", i, tokens)."""
    if not job.echo:
        return
    top_n = job.top_n if job.logprobs else 0
    rows = [PromptRow(p.ids, top_n) for p in job.prompts]
    for i, done in enumerate(prefill_many(lm.model, rows, pad_id=lm.pad_token_id)):
        emit(("prompt", i, prompt_tokens(lm, done.ids, done.numbers)))
