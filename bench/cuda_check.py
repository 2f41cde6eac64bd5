"""A CUDA check a maintainer can run where a GPU is present: lmtrace's numbers on the GPU against
transformers' own, on a random-weight model of DeepSeek-R1-Distill-Qwen-1.5B's shape (Qwen2).

Checks, each recorded pass/fail with its figures (one failing check does not stop the others):

- greedy ids = `model.generate`'s, and each step's logprob = log_softmax of `generate`'s
  `output_logits` (float32: within 1e-5; bfloat16: the ids, and the Δ reported);
- the KV record: every step's measured bytes equal the formula's (`expected_bytes`), `seq_len` =
  prompt + step;
- lens and attention: present on every step, the lens's last layer equal to the step's own
  distribution, each attention layer's weights summing to 1;
- batched rows = alone: three prompts of different lengths decoded together give each prompt's
  lone ids, logprobs within 5e-5 (float32).

Without a GPU it says so and exits 0 (`--device cpu --layers 2` runs it here end to end). The
import path needs torch, transformers, tokenizers and lmtrace (PYTHONPATH=src) only.

    python bench/cuda_check.py [--device cuda] [--layers 28] [--tokens 128] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_shapes import SHAPES, tokenizer  # noqa: E402 - the bench's own sibling module

PROMPTS = [" ".join(f"t{(31 * i + k) % 1000 + 3}" for i in range(n)) for k, n in ((1, 9), (2, 23), (3, 40))]


def build(device: str, dtype: torch.dtype, layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import lmtrace

    shape = {**SHAPES["1.5b"], "num_hidden_layers": layers}
    config = Qwen2Config(**shape, max_position_embeddings=4096, rope_theta=10000.0, eos_token_id=1,
                         pad_token_id=2, bos_token_id=None, use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 2
    source = f"random Qwen2 1.5B shape, {layers} layers"
    return lmtrace.LM.from_objects(model, tokenizer(config.vocab_size), source=source)


def against_generate(lm, tokens: int, tol: float | None) -> dict:
    """lmtrace's greedy trace against model.generate(output_logits=True) on the first prompt."""
    import lmtrace

    ids = lm.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"].to(lm.model.device)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                            min_new_tokens=tokens, output_logits=True, return_dict_in_generate=True,
                            top_k=None, top_p=None, pad_token_id=2)
    theirs = out.sequences[0, ids.shape[1]:].tolist()
    ref = torch.log_softmax(torch.cat([x.float() for x in out.logits]), -1)
    trace = lmtrace.generate(lm, PROMPTS[0], max_new_tokens=tokens, temperature=0, top_logprobs=5, stop_on_eos=False)
    ours = list(trace.token_ids)
    n = min(len(ours), len(theirs))
    delta = max(abs(s.logprob - ref[i, s.token_id].item()) for i, s in enumerate(trace.steps[:n]))
    first = next((i for i in range(n) if ours[i] != theirs[i]), None)
    kv_ok = all(s.kv.get("expected_bytes") in (None, s.kv.get("bytes_used", s.kv["bytes"])) for s in trace.steps)
    seq_ok = all(s.kv["seq_len"] == ids.shape[1] + i for i, s in enumerate(trace.steps))
    return {"tokens": n, "ids_equal": ours == theirs, "first_difference": first, "max_abs_logprob_diff": delta,
            "kv_expected_equals_measured": kv_ok, "kv_seq_len_right": seq_ok,
            "kv_bytes_last_step": trace.steps[-1].kv["bytes"],
            "pass": ours == theirs and kv_ok and seq_ok and (tol is None or delta <= tol)}


def inside(lm) -> dict:
    """Lens and attention on 8 steps: present, the lens's last layer = the step's distribution."""
    import lmtrace

    trace = lmtrace.generate(lm, PROMPTS[1], max_new_tokens=8, temperature=0, lens=True, attention=True,
                             stop_on_eos=False)
    worst_lens, worst_sum = 0.0, 0.0
    for s in trace.steps:
        d = s.to_dict()
        last = d["lens"]["layers"][-1]
        worst_lens = max(worst_lens, abs(last["chosen_logprob"] - s.logprob))
        for layer in d["attention"]["layers"]:
            mass = sum(t["weight"] for t in layer["top"])
            worst_sum = max(worst_sum, mass - 1.0)  # the top positions hold at most all of it
    return {"steps": len(trace.steps), "lens_last_layer_vs_step": worst_lens, "attention_top_mass_over_1": worst_sum,
            "pass": worst_lens <= 1e-4 and worst_sum <= 1e-3}


def batched(lm, tokens: int) -> dict:
    """Three prompts decoded together against each alone (float32)."""
    import lmtrace

    together = lmtrace.generate(lm, PROMPTS, max_new_tokens=tokens, temperature=0, stop_on_eos=False)
    alone = [lmtrace.generate(lm, p, max_new_tokens=tokens, temperature=0, stop_on_eos=False) for p in PROMPTS]
    ids_equal = all(list(a.token_ids) == list(t.token_ids) for a, t in zip(alone, together))
    delta = max(abs(x.logprob - y.logprob) for a, t in zip(alone, together) for x, y in zip(a.steps, t.steps))
    return {"rows": len(PROMPTS), "tokens": tokens, "ids_equal": ids_equal, "max_abs_logprob_diff": delta,
            "pass": ids_equal and delta <= 5e-5}


def checked(name: str, fn: Callable[[], dict], record: dict, out: Path) -> None:
    started = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - a failing check is its result; the others still run
        result = {"pass": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    result["seconds"] = round(time.perf_counter() - started, 2)
    record["checks"][name] = result
    print(f"{name}: {'pass' if result.get('pass') else 'FAIL'} {json.dumps(result)[:300]}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(out)


def one_dtype(args, dtype: torch.dtype, tol: float | None, record: dict, out: Path) -> None:
    lm = build(args.device, dtype, args.layers)
    name = str(dtype).removeprefix("torch.")
    checked(f"{name}: greedy vs model.generate, KV record", lambda: against_generate(lm, args.tokens, tol), record, out)
    if dtype == torch.float32:
        checked("float32: lens and attention", lambda: inside(lm), record, out)
        checked("float32: batched rows = alone", lambda: batched(lm, min(args.tokens, 32)), record, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/cuda-check.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the CUDA check is skipped")
        return 0
    from lmtrace.versions import versions

    out = Path(args.out)
    record = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "versions": versions(),
              "layers": args.layers, "checks": {}}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, None)):
        one_dtype(args, dtype, tol, record, out)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    record["imported"] = {m: m in sys.modules for m in ("fastapi", "uvicorn", "gguf")}
    checked("summary", lambda: {"pass": all(c.get("pass") for c in record["checks"].values())}, record, out)
    return 0 if record["checks"]["summary"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
