"""Requests/s and latency of `lmtrace serve` under concurrent short requests, on the bundled
model: the app runs on uvicorn on a free loopback port in this process, and N clients send
the same short completion at once. Usage: python bench/serve_concurrent.py [--clients 8]"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time

import httpx
import uvicorn

import lmtrace
from lmtrace.server import create_app


async def round_(url: str, clients: int, body: dict) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:

        async def one() -> float:
            started = time.perf_counter()
            r = await c.post("/v1/completions", json=body)
            r.raise_for_status()
            return time.perf_counter() - started

        started = time.perf_counter()
        latencies = await asyncio.gather(*(one() for _ in range(clients)))
        return time.perf_counter() - started, list(latencies)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    lm = lmtrace.load()
    app = create_app(lm, max_concurrency=args.clients)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    body = {"prompt": "The capital of France is", "max_tokens": args.max_tokens, "temperature": 0, "logprobs": 5}
    asyncio.run(round_(url, 1, body))  # warm-up
    print("| clients | max_tokens | requests/s | p50 latency s | p95 latency s |\n|---|---|---|---|---|")
    for clients in (1, args.clients):  # one alone first: the machine's own speed, for reference
        walls, latencies = [], []
        for _ in range(args.rounds):
            wall, lat = asyncio.run(round_(url, clients, body))
            walls.append(wall)
            latencies += lat
        latencies.sort()
        p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
        rps = clients * args.rounds / sum(walls)
        print(f"| {clients} | {args.max_tokens} | {rps:.2f} | {statistics.median(latencies):.2f} | {p95:.2f} |")
    server.should_exit = True


if __name__ == "__main__":
    main()
