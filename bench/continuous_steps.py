"""The continuous batch's join and cache costs, in-process on the bundled model (float32, `--matmul
onednn`, one thread), each pair of arms interleaved round by round:

- join: with 7 rows decoding, a plain step; the step in whose forward a 6-token prompt rides
  (lmtrace.decode.tree_prefill.Ride); a separate join (the prompt prefilled in a forward of its own, as
  before the ride). Medians over `--joins` of each.
- clients: 8 clients, each sending `--requests` requests one after another (24 to 40 tokens, so
  rows end at different steps and later requests join a running batch), with the joining prompts
  riding in the decode forward, and with a separate prefill for each join. Aggregate tokens/s.
- layer: 8 rows decoding, steps alternating between each Llama decoder layer as one function over
  the packed products (lmtrace.model.layer_path, `--matmul onednn`'s) and transformers' own layer
  forward on the same kernels (the same numbers bit for bit). Medians over `--joins` steps of each.
- room: 8 rows x 200 and x 1000 positions decoding 8 steps, the batch's cache with room for 32 positions
  (written in place) and as transformers' DynamicLayer (every step copies the whole cache).
  Milliseconds a step.

Writes a markdown table and, with --json, every round (after each measurement, atomically).

Usage: python bench/continuous_steps.py [--rounds 3] [--json bench/results/continuous_steps.json]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import lmtrace
from lmtrace import SamplingParams
from lmtrace.decode import continuous, engine, tracing
from lmtrace.decode.continuous import ContinuousBatch, RowSpec
from lmtrace.decode.prefill import PromptRow, prefill_many
from lmtrace.files import write_atomic
from lmtrace.kv import ledger
from lmtrace.model import layer_path

PROMPTS = ["The capital of France is", "Once upon a time", "Write a haiku about rain.", "My favourite animal is",
           "In 1969, the first", "A good breakfast has", "The ocean is", "How do plants grow?"]  # fmt: skip


def spec(lm, i: int, tokens: int) -> RowSpec:
    text = PROMPTS[i % len(PROMPTS)]
    params = SamplingParams(temperature=0, max_new_tokens=tokens, stop_on_eos=False, top_logprobs=1)
    return RowSpec(tracing.encode_prompt(lm, text), params, text)


def separately(lm, batch: ContinuousBatch, specs: list[RowSpec]) -> None:
    """The prompts prefilled in a forward of their own, then joined (the way before the ride)."""
    rows = [PromptRow(list(s.ids), share=False) for s in specs]
    batch.join_prefilled(specs, prefill_many(lm.model, rows, pad_id=lm.pad_token_id, keep_kv=True))


def join(lm, joins: int) -> dict[str, float]:
    batch = ContinuousBatch(lm, 16)
    batch.join_many([spec(lm, i, 1000) for i in range(7)])
    for _ in range(20):
        batch.step()
    times: dict[str, list[float]] = {"plain step ms": [], "step with a prompt riding ms": [], "separate join ms": []}
    for k in range(joins):  # each joined row leaves at its first step
        new = [spec(lm, k, 1)]
        for name, run in (("plain step ms", batch.step),
                          ("step with a prompt riding ms", lambda new=new: batch.step(continuous.prefilling(lm, new))),
                          ("separate join ms", lambda new=new: separately(lm, batch, new))):  # fmt: skip
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(v) for name, v in times.items()}


def layer(lm, steps: int) -> dict[str, float]:
    batch = ContinuousBatch(lm, 16)
    batch.join_many([spec(lm, i, 1000) for i in range(8)])
    for _ in range(10):
        batch.step()
    times: dict[str, list[float]] = {"8-row step ms, layer function": [], "8-row step ms, transformers' layers": []}
    for k in range(2 * steps):
        ours = k % 4 in (0, 3)  # ABBA: each arm as often first as second
        layer_path.install(lm.model) if ours else layer_path.remove(lm.model)
        started = time.perf_counter()
        batch.step()
        times[list(times)[0 if ours else 1]].append((time.perf_counter() - started) * 1000)
    layer_path.install(lm.model)
    return {name: statistics.median(v) for name, v in times.items()}


def clients(lm, ride: bool, requests: int, count: int = 8) -> float:
    batch = ContinuousBatch(lm, 16)
    lengths = {c: 24 + (c * 5) % 17 for c in range(count)}
    pending = [spec(lm, c, lengths[c]) for c in range(count)]
    owner = {id(s): c for c, s in enumerate(pending)}
    left = {c: requests - 1 for c in range(count)}
    tokens, started = 0, time.perf_counter()
    while pending or not batch.empty:
        joining = None
        if pending and batch.rows and ride:
            joining = continuous.prefilling(lm, pending)
        elif pending:
            separately(lm, batch, pending)
        pending = []
        for row in batch.step(joining):
            tokens += len(row.trace.token_ids)
            c = owner[id(row.spec)]
            if left[c]:
                left[c] -= 1
                nxt = spec(lm, c + 1 + left[c], lengths[c])
                owner[id(nxt)] = c
                pending.append(nxt)
    return tokens / (time.perf_counter() - started)


_PREFILLED: dict[tuple[int, int], list] = {}


def room(lm, spare: int, rows: int = 8, width: int = 200, steps: int = 8) -> float:
    """Median step time of `steps` decode steps from a prefilled `rows` x `width` cache (prefilled
    once per size, copied for each run)."""
    model = lm.model
    with torch.inference_mode():
        if (rows, width) not in _PREFILLED:
            ids = torch.randint(100, 40_000, (rows, width), generator=torch.Generator().manual_seed(0))
            cache = ledger.new_cache(model)
            engine.prefill(model, ids, None, cache)
            _PREFILLED[(rows, width)] = ledger.layers_of(cache)
        cache = ledger.cache_of(model, [(k.clone(), v.clone()) for k, v in _PREFILLED[(rows, width)]])
        if spare:  # else transformers' own DynamicLayer
            ledger.with_room(cache, spare)
        mask = torch.ones((rows, width), dtype=torch.long)
        times = []
        for i in range(steps):
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
            started = time.perf_counter()
            engine.decode_step(model, torch.arange(rows) + 100, torch.full((rows, 1), width + i), mask, cache)
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def write(path: Path | None, record: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--joins", type=int, default=12, help="joins of each kind per round")
    ap.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lm = lmtrace.load(matmul="onednn")
    record: dict = {"args": vars(args) | {"json": str(args.json)}, "threads": torch.get_num_threads(), "rounds": []}
    clients(lm, True, 1)  # warm-up
    for r in range(args.rounds):
        got = {**join(lm, args.joins), **layer(lm, args.joins)}
        for ride in (True, False):
            got[f"8 clients tok/s, joins {'riding' if ride else 'separate'}"] = clients(lm, ride, args.requests)
        for width in (200, 1000):
            for spare in (continuous.ROOM, 0):
                kind = f"room {spare}" if spare else "DynamicLayer"
                got[f"8 x {width} step ms, {kind}"] = room(lm, spare, width=width)
        record["rounds"].append(got)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
        write(args.json, record)
    names = list(record["rounds"][0])
    print(f"\nbundled model, float32, --matmul onednn, {record['threads']} thread(s), median of {args.rounds} rounds")
    print("| measure | median | rounds |\n|---|---|---|")
    for name in names:
        values = [x[name] for x in record["rounds"]]
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
