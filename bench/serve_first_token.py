"""The first token of a single request while a 4,096-row request runs, on `lmtrace serve`'s
batching server (bundled model, `max_batch` 16, `--max-rows-per-request` 4096): a request of 256
prompts x n 16 (ignore_eos, streamed) starts; once its tokens flow, one single request is
streamed and its time to first token measured, against the large request's decode step time
(the interval between two of its steps, from the times its chunks arrive) and the single
request's first token on an idle server. Several rounds, the large request cancelled after each
(its stream closed). Also /health, polled while a 5 MB prompt is being refused: its slowest
answer (--health-only: that alone). Writes a
markdown table and, with --json, the raw figures; a round that fails is recorded as failed.

Usage: python bench/serve_first_token.py [--rounds 3] [--json bench/results/serve_first_token.json]"""

from __future__ import annotations

import argparse
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

BIG = {"prompt": ["Tell me a long story about the sea."] * 256, "n": 16, "max_tokens": 512, "ignore_eos": True,
       "temperature": 0.8, "seed": 1, "stream": True}  # fmt: skip
COLUMNS = {
    "idle_first_token_s": "single request's first token, idle s",
    "first_token_s": "under the 4,096-row request s",
    "step_s": "its decode step s",
    "steps": "first token in steps",
    "health_s": "slowest /health during a 5 MB prompt s",
    "health_median_s": "median /health s",
    "refused_after_s": "the 5 MB prompt refused after s",
}
SINGLE = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True}


def serve(lm) -> tuple[uvicorn.Server, str]:
    app = create_app(lm, max_batch=16, max_rows=4096, max_body_bytes=8 << 20)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def first_token_s(url: str) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=SINGLE, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - started
    raise RuntimeError("no token came")


def under_load(url: str, warm_steps: int = 20) -> dict:
    """The single request's first token while the large one decodes, and the large one's step."""
    arrivals: list[tuple[float, int]] = []  # (time, choice index) of each of the large request's chunks
    stop = threading.Event()

    def big() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=BIG, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.perf_counter(), json.loads(line[6:])["choices"][0]["index"]))
                if stop.is_set():
                    return  # closing the stream cancels the request

    thread = threading.Thread(target=big, daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while len({i for _, i in arrivals}) < 8 or len(arrivals) < warm_steps * 14:  # its rows are decoding
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the large request did not start")
        time.sleep(0.05)
    first = first_token_s(url)
    times = [t for t, i in arrivals if i == arrivals[-1][1]]  # one row's chunks: one a step
    step = statistics.median(b - a for a, b in zip(times, times[1:]))
    stop.set()
    thread.join(60)
    return {"first_token_s": first, "step_s": step, "steps": first / step}


def health_during_large_prompt(url: str) -> dict:
    """/health polled (every 20 ms, one at a time) from the moment a 5.2 MB prompt is sent until
    it is answered: the slowest /health answer and the median, and how long the refusal took.
    The body is encoded before the clock starts, so the client's own JSON work is not counted."""
    body = json.dumps({"prompt": "Hello world, " * 400_000, "max_tokens": 1}).encode()  # 5.2 MB
    out: dict = {}

    def large() -> None:
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=600)  # fmt: skip
        out["status"], out["refused_at"] = r.status_code, time.perf_counter()

    started = time.perf_counter()
    t = threading.Thread(target=large, daemon=True)
    t.start()
    answers = []
    with httpx.Client(timeout=60) as client:
        while t.is_alive():
            asked = time.perf_counter()
            client.get(f"{url}/health").raise_for_status()
            answers.append(time.perf_counter() - asked)
            time.sleep(0.02)
    t.join()
    out["health_s"] = max(answers, default=float("nan"))  # the slowest answer while it was refused
    out["health_median_s"] = statistics.median(answers) if answers else float("nan")
    out["health_asked"] = len(answers)
    out["refused_after_s"] = out.get("refused_at", started) - started
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--health-only", action="store_true", help="only /health during a 5 MB prompt")
    args = ap.parse_args()
    lm = lmtrace.load()
    server, url = serve(lm)
    first_token_s(url)  # warm-up
    rounds = []
    for r in range(args.rounds):
        try:
            if args.health_only:
                row = health_during_large_prompt(url)
            else:
                row = {"idle_first_token_s": first_token_s(url), **under_load(url), **health_during_large_prompt(url)}
        except Exception as e:  # a failed round is written down, the others still run
            row = {"failed": f"{type(e).__name__}: {e}"}
        rounds.append(row)
        print(f"round {r + 1}: {row}", flush=True)
    ok = [x for x in rounds if "failed" not in x]
    print("\nbundled model, max_batch 16; a 256 x 16 = 4,096-row request streaming; median of", len(ok), "rounds")
    print("| " + " | ".join(COLUMNS.values()) + " |")
    print("|" + "---|" * len(COLUMNS))
    cells = [f"{statistics.median(x[k] for x in ok):.3f}" if ok and k in ok[0] else "-" for k in COLUMNS]
    print("| " + " | ".join(cells) + " |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rounds": rounds}))
    server.should_exit = True


if __name__ == "__main__":
    main()
