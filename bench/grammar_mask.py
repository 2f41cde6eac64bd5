"""The grammar mask's cost per decoding step on the bundled model, at batch 1 and 16.

What a constrained step adds to an unconstrained one, timed piece by piece on real logits and on
matchers in a costly state (inside a JSON string, where most of the vocabulary is allowed and
xgrammar checks the most tokens): each row's bitmask (xgrammar's fill_next_token_bitmask), its
unpacking into a (batch, vocab) mask, the mask applied to the logits, the step's grammar numbers
(allowed, removed_mass, constrained logprob) and each matcher moved past its token. The step it
is compared with is a whole unconstrained step of lmtrace.generate (forward pass and `take`) at
the same batch size, the median over its decode steps. Medians over rounds; one process.

Usage: python bench/grammar_mask.py [--rounds 30] [--batch-sizes 1,16] [--threads N] [--json FILE]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import lmtrace
from lmtrace import SamplingParams
from lmtrace.decode import constrained
from lmtrace.logits import grammar
from lmtrace.versions import versions

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "population", "tags"],
}  # fmt: skip
PREFIX = '{"city":"Pa'  # inside a string: the state where the most tokens must be checked
PROMPT = "Give me a JSON object about Paris."


def ms(f, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        f()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def mask_cost(lm, batch: int, rounds: int) -> dict[str, float]:
    """The median ms of each piece a constrained step adds, for `batch` rows."""
    compiler = constrained.compiler(lm)
    rows = [compiler.matcher(SamplingParams(json_schema=SCHEMA)) for _ in range(batch)]
    for m in rows:
        assert m.matcher.accept_string(PREFIX)
    vocab = lm.model.config.vocab_size
    ids = lmtrace.encode_prompt(lm, PROMPT, chat=True)
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids] * batch)).logits[:, -1].float()  # (batch, vocab)
    active = [True] * batch
    allowed = grammar.allowed_tokens(rows, vocab, active)
    tokens = grammar.mask(logits, allowed).argmax(-1)

    def accept_and_back() -> None:
        grammar.accept(rows, tokens, active)
        for m in rows:
            m.matcher.rollback(1)

    bitmask = grammar.engine().allocate_token_bitmask(batch, vocab)
    out = {
        "fill": ms(lambda: [m.fill(bitmask, r) for r, m in enumerate(rows)], rounds),
        "allowed": ms(lambda: grammar.allowed_tokens(rows, vocab, active), rounds),
        "mask": ms(lambda: grammar.mask(logits, allowed), rounds),
        "numbers": ms(lambda: grammar.numbers(logits, allowed, tokens, active), rounds),
        "accept": ms(accept_and_back, rounds),
        "allowed_tokens_mean": float(allowed.sum(-1).float().mean()),
    }
    out["total"] = out["allowed"] + out["mask"] + out["numbers"] + out["accept"]
    return out


def step_ms(lm, batch: int, tokens: int = 24) -> float:
    """The median decode step of an unconstrained greedy lmtrace.generate at `batch` rows."""
    traces = lmtrace.generate(lm, [PROMPT] * batch, chat=True, temperature=0, max_new_tokens=tokens,
                              stop_on_eos=False, top_logprobs=5)  # fmt: skip
    return statistics.median(s.time_ms for s in traces[0].steps[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = lmtrace.load()
    results = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        cost, step = mask_cost(lm, batch, args.rounds), step_ms(lm, batch)
        results.append({"batch": batch, "step_ms": step, **cost, "share_of_step": cost["total"] / step})
        r = results[-1]
        print(f"batch {batch:2d}: step {step:7.1f} ms; grammar adds {r['total']:6.2f} ms = {r['share_of_step']:.1%} "
              f"(bitmasks {r['fill']:.2f} + unpack = {r['allowed']:.2f}, mask {r['mask']:.2f}, "
              f"numbers {r['numbers']:.2f}, accept {r['accept']:.2f}; {r['allowed_tokens_mean']:.0f} tokens allowed)",
              flush=True)  # fmt: skip
    doc = {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "versions": versions(), "results": results}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
