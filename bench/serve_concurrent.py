"""Aggregate tokens/s and latency of `lmtrace serve` under concurrent clients, on the bundled
model: greedy, 64 tokens per request (end token ignored, so every request generates exactly
that many), short prompts. Two servers run in this process on free loopback ports, side by
side on the same loaded model: the batching one (requests decoded together, `max_batch` 16)
and the old one-at-a-time one (`max_batch` 1). For each round, each client count, and each
server in turn (interleaved, so a busy machine slows both alike), N clients each send one
request at once. Writes a markdown table (median over rounds) and the raw figures as JSON.

Usage: python bench/serve_concurrent.py [--clients 1 4 8 16] [--rounds 2] [--max-tokens 64]
       [--json bench/results/serve_concurrent.json]"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import uvicorn

import lmtrace
from lmtrace.server import create_app

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "Write a haiku about rain.",
    "The best way to learn Python is",
    "My favourite animal is",
    "In 1969, the first",
    "A good breakfast has",
    "The ocean is",
    "How do plants grow?",
    "The meaning of life is",
    "Tell me about the moon.",
    "Coffee or tea?",
    "The weather today is",
    "A short story about a cat:",
    "List three colours:",
    "Why is the sky blue?",
]
SERVERS = {"batching (max_batch 16)": 16, "one at a time (max_batch 1)": 1}


def serve(lm, max_batch: int, clients: int) -> tuple[uvicorn.Server, str]:
    app = create_app(lm, max_concurrency=max(clients, 16), max_batch=max_batch)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def round_(url: str, clients: int, max_tokens: int) -> dict:
    """N clients, one request each, all at once: wall time, tokens, each request's latency."""
    async with httpx.AsyncClient(base_url=url, timeout=3600) as c:

        async def one(k: int) -> tuple[float, int]:
            body = {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            started = time.perf_counter()
            r = await c.post("/v1/completions", json=body)
            r.raise_for_status()
            return time.perf_counter() - started, r.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        done = await asyncio.gather(*(one(k) for k in range(clients)))
        wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens": sum(t for _, t in done), "latencies_s": [lat for lat, _ in done]}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    lm = lmtrace.load()
    servers = {name: serve(lm, mb, max(args.clients)) for name, mb in SERVERS.items()}
    for _, url in servers.values():
        asyncio.run(round_(url, 1, 4))  # warm-up
    runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in args.clients} for name in servers}
    for r in range(args.rounds):
        for n in args.clients:
            for name, (_, url) in servers.items():
                runs[name][n].append(asyncio.run(round_(url, n, args.max_tokens)))
                last = runs[name][n][-1]
                print(f"round {r + 1}: {name}, {n} clients: {last['tokens'] / last['wall_s']:.1f} tok/s", flush=True)
    rows = []
    for name in servers:
        lone = statistics.median(x["tokens"] / x["wall_s"] for x in runs[name][args.clients[0]])
        lone_p50 = statistics.median(lat for x in runs[name][args.clients[0]] for lat in x["latencies_s"])
        for n in args.clients:
            rate = statistics.median(x["tokens"] / x["wall_s"] for x in runs[name][n])
            lats = [lat for x in runs[name][n] for lat in x["latencies_s"]]
            p50, p95 = statistics.median(lats), percentile(lats, 0.95)
            rows.append({"server": name, "clients": n, "tokens_per_s": rate, "speedup": rate / lone,
                         "p50_s": p50, "p95_s": p95, "p95_vs_lone": p95 / lone_p50})  # fmt: skip
    print(f"\nbundled model, greedy, {args.max_tokens} tokens per request, median of {args.rounds} rounds")
    print("| server | clients | aggregate tok/s | × 1 client | p50 latency s | p95 latency s | p95 / lone p50 |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['server']} | {x['clients']} | {x['tokens_per_s']:.1f} | {x['speedup']:.2f} | "
              f"{x['p50_s']:.2f} | {x['p95_s']:.2f} | {x['p95_vs_lone']:.2f} |")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows, "runs": runs}))
    for server, _ in servers.values():
        server.should_exit = True


if __name__ == "__main__":
    main()
