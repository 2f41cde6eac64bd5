"""Golden cases: the JSON the CLI and the server give for fixed inputs on the bundled model,
recorded once (record.py) on the code before the families moved into folders; test_golden.py
checks that today's code still gives them (token ids and texts identical, numbers within 1e-6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent / "recorded"
# float32 kernels round differently on another CPU (other SIMD paths: up to 2e-5 measured between two
# AMD EPYC generations): a CPU with a recording of its own (recorded/<cpu>/, made from the same
# pinned code) is held to 1e-6; another is compared with the first recording at ACROSS_CPUS, a KL
# (it compares two distributions, so its rounding is up to both's: 6.9e-5 measured between an AMD
# EPYC and an Intel Xeon, at the logit lens's middle layers) at twice that
ACROSS_CPUS = 5e-5
TWO_DISTRIBUTIONS = {"kl", "kl_to_final"}


def cpu() -> str:
    """This machine's CPU as a recording's folder name: vendor, family, model, torch's SIMD level."""
    import torch

    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    parts = [info.get("vendor_id", "cpu"), info.get("cpu family", "0"), info.get("model", "0")]
    return "-".join([*parts, torch.backends.cpu.get_cpu_capability()]).replace(" ", "_")


def recorded() -> tuple[Path, float]:
    """The recording to compare with and the tolerance: this CPU's own at 1e-6, else the first."""
    own = HERE / cpu()
    return (own, 1e-6) if own.is_dir() else (HERE, ACROSS_CPUS)

# name -> CLI arguments; "{out}" is the JSON file the command writes
CLI_CASES: dict[str, list[str]] = {
    "generate_greedy_inside": [
        "generate", "The capital of France is", "--max-new-tokens", "6", "--temperature", "0",
        "--top-logprobs", "3", "--lens", "--attention", "--echo", "--waterfall", "all", "--json", "{out}",
    ],
    "generate_sampled_processors": [
        "generate", "Once upon a time", "--max-new-tokens", "10", "--temperature", "0.8", "--top-k", "40",
        "--top-p", "0.9", "--min-p", "0.02", "--repetition-penalty", "1.3", "--seed", "7",
        "--top-logprobs", "4", "--waterfall", "all", "--json", "{out}",
    ],
    "score": ["score", "The quick brown fox jumps over the lazy dog.", "--top-logprobs", "3", "--json", "{out}"],
    "kv_lab": [
        "kv-lab", "The history of the city begins with", "--max-new-tokens", "8",
        "--policy", "window:size=6", "--policy", "streaming:sinks=2,window=4", "--json", "{out}",
    ],
    "branch": [
        "branch", "My favourite colour is", "--at", "1", "--max-new-tokens", "5", "--temperature", "0",
        "--top-logprobs", "2", "--json", "{out}",
    ],
}  # fmt: skip

TRACES_REQUEST: dict[str, Any] = {
    "prompt": "Hello, my name is",
    "max_tokens": 5,
    "temperature": 0.7,
    "seed": 3,
    "top_logprobs": 3,
    "top_p": 0.95,
}

# keys added to the records since the goldens were recorded (extensions: the recorded fields
# beside them are still compared): each attention layer's value-weighted attention (issue 28)
# the KV anatomy's bytes_per_token_full, full_layers, groups; the model summary's sliding (issue 35);
# a branch's steps' kv expected_bytes (the formula checked at every step, as generate's; issue 33)
ADDED = {"value_weighted", "bytes_per_token_full", "full_layers", "groups", "sliding", "expected_bytes"}

# keys whose values change from run to run or machine to machine
VOLATILE = {"time_ms", "timing", "versions", "source", "created", "id", "elapsed_ms", "seconds", "path"}


def normalize(value: Any) -> Any:
    """The comparable part of a JSON document: volatile keys dropped."""
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in VOLATILE and not k.endswith("_ms")}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def differences(old: Any, new: Any, where: str = "$", tol: float = 1e-6) -> list[str]:
    """Where two normalized documents differ: strings, ints and structure exactly, floats within
    tol (relative above 1: a perplexity of 125 is as exact as a logprob of -1)."""
    if isinstance(old, dict) and isinstance(new, dict):
        changed = (set(old) - set(new)) | (set(new) - set(old) - ADDED)  # a recorded key missing, or a new one
        out = [f"{where}: keys {sorted(changed)}"] if changed else []
        for k in sorted(set(old) & set(new)):
            out += differences(old[k], new[k], f"{where}.{k}", tol * (2 if k in TWO_DISTRIBUTIONS else 1))
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{where}: length {len(old)} != {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{where}[{i}]", tol)]
    if isinstance(old, float) or isinstance(new, float):
        if isinstance(old, bool) or isinstance(new, bool) or old is None or new is None:
            return [] if old == new else [f"{where}: {old!r} != {new!r}"]
        if abs(float(old) - float(new)) <= tol * max(1.0, abs(float(old))):  # relative above 1 (a perplexity)
            return []
        return [f"{where}: {old!r} != {new!r}"]
    return [] if old == new else [f"{where}: {old!r} != {new!r}"]


def load(name: str, where: Path | None = None) -> Any:
    return json.loads(((where or HERE) / f"{name}.json").read_text(encoding="utf-8"))
