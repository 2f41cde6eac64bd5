"""Running an audit: connect (the server answers, takes the key, serves the model asked for),
check that it tokenizes as the model does (else it serves another model: bad input), then run
each probe, turning what the server does not offer into a skip and any other error into a fail."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmtrace import arguments
from lmtrace.comparison.audit.base import Context, Skip
from lmtrace.comparison.audit.client import DEFAULT_TIMEOUT, HTTPFailure, Unreachable
from lmtrace.comparison.audit.connect import (
    DEFAULT_TOLERANCE,
    MAX_TOKENS,
    PROBE_NAMES,
    Server,
    check_probes,
    check_tolerance,
    connect,
)
from lmtrace.comparison.audit.preflight import check_tokenization
from lmtrace.comparison.audit.probes_bytes import probe_bytes
from lmtrace.comparison.audit.probes_format import probe_stop, probe_tokenize, probe_usage
from lmtrace.comparison.audit.probes_model import probe_chat, probe_echo, probe_logprobs
from lmtrace.comparison.audit.probes_server import probe_concurrency, probe_prompts, probe_repeat, probe_streaming
from lmtrace.comparison.audit.probes_top import probe_top_logprobs
from lmtrace.comparison.audit.reference import Reference
from lmtrace.comparison.audit.result import AuditReport, ProbeResult
from lmtrace.model.lm import LM
from lmtrace.versions import versions


@dataclass(frozen=True)
class AuditOptions:
    """How `audit` runs besides the model and the server: `api_key`, `served_model` and
    `timeout` reach the server (when `server` is a URL, `connect` uses them); `probes` (None:
    all) are run in order; `tolerance` is the largest |Δ logprob| that counts as equal;
    `max_tokens` per generation; `on_probe(result)` hears each probe as it ends."""

    api_key: str | None = None
    served_model: str | None = None
    probes: Sequence[str] | None = None
    tolerance: float = DEFAULT_TOLERANCE
    max_tokens: int = MAX_TOKENS
    timeout: float = DEFAULT_TIMEOUT
    on_probe: Callable[[ProbeResult], Any] | None = None


PROBES: dict[str, Callable[[Context], ProbeResult]] = {
    "logprobs": probe_logprobs,
    "echo": probe_echo,
    "top_logprobs": probe_top_logprobs,
    "streaming": probe_streaming,
    "prompts": probe_prompts,
    "repeat": probe_repeat,
    "concurrency": probe_concurrency,
    "usage": probe_usage,
    "stop": probe_stop,
    "chat": probe_chat,
    "bytes": probe_bytes,
    "tokenize": probe_tokenize,
}
assert tuple(PROBES) == PROBE_NAMES, "connect.PROBE_NAMES lists the probes, for the CLI's help"


def run_probe(name: str, ctx: Context) -> ProbeResult:
    """One probe; a route or feature the server does not offer is a skip, saying which."""
    started = time.perf_counter()
    try:
        result = PROBES[name](ctx)
    except Skip as e:
        result = ProbeResult(name, "skip", str(e))
    except HTTPFailure as e:
        body = e.request.get("body")
        evidence = {"request": e.request, "status": e.status, "response": e.body}
        if body is not None and e.request.get("path"):
            evidence["curl"] = ctx.client.curl(e.request["path"], body)
        if e.status in (400, 404, 405, 422, 501):
            what = "route" if e.status in (404, 405, 501) else "request"
            result = ProbeResult(
                name, "skip", f"the server refused the {what} (HTTP {e.status}: {e.message()})", evidence=evidence
            )
        else:
            result = ProbeResult(name, "fail", f"HTTP {e.status}: {e.message()}", evidence=evidence)
    except Unreachable as e:
        result = ProbeResult(name, "fail", f"the server stopped answering ({e})")
    result.seconds = time.perf_counter() - started
    return result


def audit(lm: LM, server: Server | str, options: AuditOptions | None = None, **keywords: Any) -> AuditReport:
    """Audits the logprobs of a live OpenAI-compatible server that serves `lm`'s weights: each
    probe sends real requests and compares what comes back with lmtrace's own numbers for the
    same tokens (teacher forcing). `server` is a URL or what `connect` returned; `options`
    (AuditOptions), or its fields as keywords (tolerance=..., probes=[...], ...)."""
    o = arguments.options(AuditOptions, options, "audit", keywords)
    names = check_probes(o.probes)
    tolerance = check_tolerance(o.tolerance)
    if isinstance(server, str):
        server = connect(server, api_key=o.api_key, served_model=o.served_model, timeout=o.timeout)
    started = time.perf_counter()
    ctx = Context(server.client, Reference(lm), server.served, tolerance, o.max_tokens)
    preflight = check_tokenization(ctx)
    report = AuditReport(
        server.client.url, server.served, lm.source, tolerance, preflight=preflight, versions=versions()
    )
    for name in names:
        result = run_probe(name, ctx)
        report.probes.append(result)
        if o.on_probe is not None:
            o.on_probe(result)
    report.seconds = time.perf_counter() - started
    return report
