"""GET /metrics: the server's counters in Prometheus' text format, as vLLM's /metrics (which
names its own `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` in tokens): how many
prompt tokens were looked up in the prefix cache and how many it served, its bytes against its
bound, the requests finished and cancelled, and the batch's decode steps (those whose forward
also prefilled the prompts joining the batch counted apart, as vLLM counts its mixed batches)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from lmtrace.server.batcher import BatchingWorker
from lmtrace.server.generation import ServerState

router = APIRouter()

HELP = {
    "enabled": ("gauge", "1 when the prefix cache is on"),
    "max_bytes": ("gauge", "the prefix cache's bound in bytes"),
    "bytes": ("gauge", "bytes the prefix cache holds (KV tensors and an estimate of the numbers)"),
    "peak_bytes": ("gauge", "the most bytes the prefix cache has held"),
    "entries": ("gauge", "prompts the prefix cache holds"),
    "queried_tokens": ("counter", "prompt tokens looked up in the prefix cache"),
    "hit_tokens": ("counter", "prompt tokens not computed again: from the cache, or shared in one forward"),
    "lookups": ("counter", "prompts looked up in the prefix cache"),
    "hits": ("counter", "prompts that reused a computed beginning"),
    "evictions": ("counter", "entries evicted, least recently used first"),
    "skipped": ("counter", "prompts larger than the whole bound, not kept"),
    "cleared": ("counter", "times the cache was emptied because the model's weights changed"),
}


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.lmtrace
    worker = state.worker
    lines = []
    counts = {"requests_finished": worker.finished, "requests_cancelled": worker.cancelled}
    for name, value in counts.items():
        lines += [f"# TYPE lmtrace_{name}_total counter", f"lmtrace_{name}_total {value}"]
    if isinstance(worker, BatchingWorker):
        steps = {"decode_steps": worker.stats["steps"], "decode_steps_with_prefill": worker.stats["ridden"]}
        for name, value in steps.items():
            lines += [f"# TYPE lmtrace_{name}_total counter", f"lmtrace_{name}_total {value}"]
    prefix = worker.lane.metrics() if isinstance(worker, BatchingWorker) else {"enabled": 0}
    for name, value in prefix.items():
        kind, text = HELP[name]
        metric = f"lmtrace_prefix_cache_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {metric} {text}", f"# TYPE {metric} {kind}", f"{metric} {value}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
