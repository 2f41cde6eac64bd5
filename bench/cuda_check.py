"""The CUDA check a maintainer runs where a GPU is present: lmtrace against transformers on a
random-weight model of a real architecture's shape (Qwen2 as DeepSeek-R1-Distill-Qwen-1.5B:
hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936), in float32 and
bfloat16, 128 tokens ignoring the end token. Each check records pass or fail with its figures and
the run goes on (one failing check never ends it):

- `greedy`: the token ids equal `model.generate`'s (greedy, eager), the logprobs within the
  dtype's tolerance of log_softmax of generate's own logits; tok/s of lmtrace's traced loop and of
  generate at batch 1;
- `kv`: every step's measured KV bytes = the formula's, per layer = 2 × kv_heads × head_dim ×
  positions × element size;
- `lens_attention`: a layer per block (+ the embedding) in the lens, its last entry the step's own
  logprob; an attention entry per block, weights and masses in [0, 1], entropies finite;
- `batched`: rows decoded as one padded batch = each alone (tokens equal, logprobs within 5e-5 in
  float32); tok/s of lmtrace and generate over --batch prompts.

    PYTHONPATH=src python bench/cuda_check.py --out cuda_check.json            # a GPU, ~2 min on an H200
    PYTHONPATH=src python bench/cuda_check.py --device cpu --layers 2 --tokens 16 --out /tmp/c.json

Without a GPU (--device cuda) it says it is skipped, writes that to --out and exits 0; exit 1
when a check failed. It needs torch, transformers and tokenizers only (no fastapi, uvicorn or
gguf: it imports lmtrace's decoding, not its server or loaders); the tokenizer is a byte-level
BPE of the model's vocabulary size built in-process (no hub)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from itertools import product
from pathlib import Path
from typing import Any

import torch

R1_DISTILL_1_5B = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=151936,
)
PROMPTS = [
    "The derivative of x^3 is",
    "Solve for x: 2x + 3 = 11.",
    "Once upon a time, in a quiet town,",
    "def fibonacci(n):",
    "很久很久以前，",
    "The capital of France is",
    "Let me think step by step.",
    "Q: What is 17 * 23? A:",
]
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3}  # greedy: lmtrace against generate's own logits
BATCH_TOLERANCE = {"float32": 5e-5, "bfloat16": 5e-2}  # a row in a padded batch against itself alone
LENS_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
MASS_SLACK = {"float32": 1e-5, "bfloat16": 1e-2}  # attention weights and masses summed in the dtype


def say(line: str) -> None:
    print(f"[cuda_check {time.strftime('%H:%M:%S')}] {line}", flush=True)


def byte_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE of `vocab_size` ids built in-process: the 256 byte symbols (no merges: a
    text encodes byte by byte), then two- and three-symbol tokens filling the vocabulary (every
    id the model can pick decodes), the last two ids `<eos>` and `<pad>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for size in (2, 3):
        for combo in product(alphabet, repeat=size):
            if len(vocab) >= vocab_size - 2:
                break
            vocab.setdefault("".join(combo), len(vocab))
    vocab["<eos>"], vocab["<pad>"] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def build_model(shape: dict[str, int], device: str, seed: int = 0) -> Any:
    """A random-init Qwen2ForCausalLM of `shape`, float32, built on `device` directly."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **shape,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
        eos_token_id=shape["vocab_size"] - 2,
        pad_token_id=shape["vocab_size"] - 1,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None  # 128 tokens whatever comes: no end token
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate(model: Any, tok: Any, prompts: list[str], tokens: int) -> Any:
    """transformers' eager greedy generate (left-padded), with its own logits per step."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    with torch.inference_mode():
        return model.generate(
            **enc, max_new_tokens=tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
        )


def timed(device: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    sync(device)
    started = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - started


def check_greedy(lm: Any, dtype: str, tokens: int, device: str) -> dict[str, Any]:
    """lmtrace's greedy ids and logprobs against model.generate's, and both loops' tok/s."""
    import lmtrace

    prompt = PROMPTS[0]
    run = lambda: lmtrace.generate(lm, prompt, max_new_tokens=tokens, temperature=0, stop_on_eos=False)  # noqa: E731
    lmtrace.generate(lm, prompt, max_new_tokens=4, temperature=0, stop_on_eos=False)  # warm-up
    hf_generate(lm.model, lm.tokenizer, [prompt], 4)
    trace, ours_s = timed(device, run)
    out, hf_s = timed(device, lambda: hf_generate(lm.model, lm.tokenizer, [prompt], tokens))
    n = len(trace.prompt["token_ids"])
    theirs = out.sequences[0, n:].tolist()
    ids_equal = trace.token_ids == theirs
    deltas = [
        abs(step.logprob - float(torch.log_softmax(logits[0].float(), -1)[tid]))
        for step, logits, tid in zip(trace.steps, out.logits, theirs)
    ]
    worst = max(deltas) if deltas else math.inf
    figures = {
        "tokens": tokens,
        "ids_equal": ids_equal,
        "first_difference": _first_difference(trace.token_ids, theirs),
        "max_abs_delta": worst,
        "tolerance": TOLERANCE[dtype],
        "lmtrace_tok_s": tokens / ours_s,
        "generate_tok_s": tokens / hf_s,
        "lmtrace_over_generate": hf_s / ours_s,
    }
    return {"passed": ids_equal and worst <= TOLERANCE[dtype], "figures": figures, "trace": trace}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_kv(lm: Any, trace: Any, dtype: str) -> dict[str, Any]:
    """Every step's measured KV bytes = the formula's, in total and per layer (a hand formula)."""
    config = lm.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    bad_steps, bad_layers = [], 0
    for step in trace.steps:
        kv, seen = step.kv, step.kv["seq_len"]
        per_layer = 2 * config.num_key_value_heads * head_dim * seen * element
        if kv["bytes"] != kv.get("expected_bytes") or kv["bytes"] != per_layer * config.num_hidden_layers:
            bad_steps.append(step.index)
        bad_layers += sum(layer["bytes"] != per_layer for layer in kv.get("layers", []))
    last = trace.steps[-1].kv
    figures = {
        "steps": len(trace.steps),
        "mismatched_steps": bad_steps,
        "mismatched_layers": bad_layers,
        "last_bytes": last["bytes"],
        "last_expected_bytes": last.get("expected_bytes"),
        "anatomy_mismatches": (trace.kv_anatomy or {}).get("mismatches"),
    }
    return {"passed": not bad_steps and not bad_layers and not figures["anatomy_mismatches"], "figures": figures}


def check_lens_attention(lm: Any, dtype: str) -> dict[str, Any]:
    """The lens and attention entries of 8 steps: present per layer and sane."""
    import lmtrace

    layers, slack = lm.model.config.num_hidden_layers, MASS_SLACK[dtype]
    trace = lmtrace.generate(
        lm, PROMPTS[1], max_new_tokens=8, temperature=0, stop_on_eos=False, lens=True, attention=True
    )
    problems: list[str] = []
    worst = 0.0
    for step in trace.steps:
        lens, attention = getattr(step, "lens", None), getattr(step, "attention", None)
        if not lens or len(lens["layers"]) != layers + 1 or not attention or len(attention["layers"]) != layers:
            problems.append(f"step {step.index}: lens or attention missing or not one entry per layer")
            continue
        worst = max(worst, abs(lens["layers"][-1]["chosen_logprob"] - step.logprob))
        for entry in attention["layers"]:
            weights = [t["weight"] for t in entry["top"]] + [entry["sink_mass"], entry["recent_mass"]]
            if not all(-slack <= w <= 1 + slack for w in weights) or not math.isfinite(entry["entropy"]):
                problems.append(f"step {step.index} layer {entry['layer']}: weights {weights[:3]}…")
        problems += [
            f"step {step.index}: kl_to_final {x['kl_to_final']}"
            for x in lens["layers"]
            if not (math.isfinite(x["kl_to_final"]) and x["kl_to_final"] >= -1e-5)
        ]
    figures = {
        "steps": len(trace.steps),
        "last_lens_layer_vs_step": worst,
        "tolerance": LENS_TOLERANCE[dtype],
        "problems": problems[:10],
    }
    return {"passed": not problems and worst <= LENS_TOLERANCE[dtype], "figures": figures}


def check_batched(lm: Any, dtype: str, tokens: int, batch: int, device: str) -> dict[str, Any]:
    """Rows of one padded batch = each alone (4 prompts of different lengths); then tok/s of
    lmtrace and generate over `batch` prompts."""
    import lmtrace

    prompts = PROMPTS[:4]
    together = lmtrace.generate(lm, prompts, max_new_tokens=tokens, temperature=0, stop_on_eos=False)
    alone = [lmtrace.generate(lm, p, max_new_tokens=tokens, temperature=0, stop_on_eos=False) for p in prompts]
    equal = [a.token_ids == b.token_ids for a, b in zip(together, alone)]
    worst = max(abs(x.logprob - y.logprob) for a, b in zip(together, alone) for x, y in zip(a.steps, b.steps))
    figures = {
        "rows": len(prompts),
        "tokens_equal": equal,
        "max_abs_delta": worst,
        "first_differences": [_first_difference(a.token_ids, b.token_ids) for a, b in zip(together, alone)],
        "tolerance": BATCH_TOLERANCE[dtype],
    }
    if batch > 1:
        many = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(batch)]
        _, ours_s = timed(
            device, lambda: lmtrace.generate(lm, many, max_new_tokens=tokens, temperature=0, stop_on_eos=False)
        )
        _, hf_s = timed(device, lambda: hf_generate(lm.model, lm.tokenizer, many, tokens))
        figures.update(
            {
                "batch": batch,
                "lmtrace_tok_s": batch * tokens / ours_s,
                "generate_tok_s": batch * tokens / hf_s,
                "lmtrace_over_generate": hf_s / ours_s,
            }
        )
    return {"passed": all(equal) and worst <= BATCH_TOLERANCE[dtype], "figures": figures}


def attempt(results: list[dict[str, Any]], dtype: str, name: str, fn: Callable[[], dict[str, Any]]) -> Any:
    """Runs one check, records pass/fail (an exception is a fail with its message), goes on."""
    say(f"{dtype}: {name} …")
    started = time.perf_counter()
    try:
        got = fn()
    except Exception as e:  # one failing check never ends the run
        got = {
            "passed": False,
            "figures": {},
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(limit=8),
        }
    extra = got.pop("trace", None)
    got.update({"dtype": dtype, "check": name, "seconds": round(time.perf_counter() - started, 2)})
    results.append(got)
    shown = {
        k: v
        for k, v in got["figures"].items()
        if k in ("max_abs_delta", "lmtrace_tok_s", "generate_tok_s", "lmtrace_over_generate", "last_lens_layer_vs_step")
    }
    say(f"{dtype}: {name} {'PASS' if got['passed'] else 'FAIL'} {json.dumps(shown)} {got.get('error', '')}")
    return extra


def run_dtype(model: Any, tok: Any, dtype: str, args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    from lmtrace.model.lm import LM

    model.to(getattr(torch, dtype))
    lm = LM.from_objects(model, tok, source=f"random Qwen2 ({model.config.num_hidden_layers} layers)")
    trace = attempt(results, dtype, "greedy", lambda: check_greedy(lm, dtype, args.tokens, args.device))
    if trace is not None:
        attempt(results, dtype, "kv", lambda: check_kv(lm, trace, dtype))
    attempt(results, dtype, "lens_attention", lambda: check_lens_attention(lm, dtype))
    attempt(results, dtype, "batched", lambda: check_batched(lm, dtype, args.tokens, args.batch, args.device))


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "device": args.device,
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--layers", type=int, default=28, help="decoder layers (28: the real model's; fewer is faster)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt, the end token ignored")
    p.add_argument("--batch", type=int, default=16, help="prompts in the throughput batch (1: none)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same vocabulary (the test's)")
    p.add_argument("--out", required=True, help="where the JSON of the figures is written")
    args = p.parse_args(argv)
    for name in ("layers", "tokens", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in TOLERANCE]
    if bad or not args.dtypes:
        p.error(f"--dtypes must be float32 and/or bfloat16, got {bad or args.dtypes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report: dict[str, Any] = {"environment": environment(args), "checks": []}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        report["skipped"] = "no CUDA device here (torch.cuda.is_available() is False)"
        say(f"skipped: {report['skipped']}")
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    shape = {**(TINY if args.tiny else R1_DISTILL_1_5B), **({} if args.tiny else {"num_hidden_layers": args.layers})}
    report["shape"] = shape
    report["tokens"] = args.tokens
    started = time.perf_counter()
    say(f"building a random Qwen2 {shape} on {args.device} …")
    tok = byte_tokenizer(shape["vocab_size"])
    model = build_model(shape, args.device)
    for dtype in args.dtypes:
        run_dtype(model, tok, dtype, args, report["checks"])
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")  # what is done so far
    report["total_s"] = round(time.perf_counter() - started, 1)
    report["passed"] = all(c["passed"] for c in report["checks"])
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    failed = [f"{c['dtype']} {c['check']}" for c in report["checks"] if not c["passed"]]
    verdict = "all checks passed" if not failed else "FAILED: " + ", ".join(failed)
    say(f"{verdict} in {report['total_s']} s; figures in {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
