"""The composability table's world: every feature as the keyword arguments of `lmtrace.generate`,
every entry point as a function of (lm, those arguments) -> the prompt's record, and the rule a
cell is judged by: equal to the same work done alone (ids identical, numbers within a bound), or
refused with one line that names both."""

from __future__ import annotations

import copy
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lmtrace
from lmtrace.errors import InvalidParameter

PROMPT = "Once upon a time"
OTHER = "Hello world, the quick"  # a second, longer row: the first row is left-padded in a batch
BASE = {"max_new_tokens": 6, "temperature": 0, "top_logprobs": 2}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def no_top_token(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A user's processor: bans the most likely token after the first two generated tokens
    (where it is not the only one left: under a grammar it may be)."""
    if len(token_ids) >= 2 and int(torch.isfinite(logits).sum()) > 1:
        logits[int(logits.argmax())] = float("-inf")
    return logits


# feature -> generate's keyword arguments (over BASE)
FEATURES: dict[str, dict[str, Any]] = {
    "lens": {"lens": True},
    "attention": {"attention": True},
    "echo": {"echo": True},
    "waterfall": {"waterfall": "all"},
    "regex": {"regex": r"[a-c]{2,4}-[0-9]{1,3}", "max_new_tokens": 10},
    "json_schema": {"json_schema": SCHEMA, "max_new_tokens": 12},
    "choice": {"choice": ("the quick", "the lazy dog", "world")},
    "draft:packed": {"draft": "packed", "draft_tokens": 3},
    "draft:layers": {"draft": "layers:1", "draft_tokens": 2},
    "stop": {"stop": ["o"], "max_new_tokens": 12},
    "penalty": {"repetition_penalty": 1.3},
    "logit_bias": {"logit_bias": {154: -100.0, 68: -100.0, 92: -100.0, 7: 3.0}},  # greedy's first tokens banned
    "seed": {"temperature": 0.8, "seed": 5},
    "top_logprobs:0": {"top_logprobs": 0},
    "top_logprobs:20": {"top_logprobs": 20},
    "processor": {"logits_processors": [no_top_token]},
    "uncertainty": {"uncertainty": True},
    "attribution": {"attribution": True},
    "compile": {"compile": True},
}
GRAMMARS = ("regex", "json_schema", "choice")
DRAFTS = ("draft:packed", "draft:layers")

# keys whose values change from run to run (times) or say how the work ran, not what it found
VOLATILE = {"time_ms", "timing", "versions", "created", "id", "crop", "speculative", "draft", "source"}


def merged(*features: str) -> dict[str, Any]:
    out = dict(BASE)
    for name in features:
        out.update(FEATURES[name])
    return out


def comparable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def differences(a: Any, b: Any, tol: float, path: str = "$") -> list[str]:
    """Where two records differ: ints, strings and structure exactly, floats within `tol` (relative
    above 1: a perplexity of 1166 is as exact as a logprob of -1)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in set(a) ^ set(b)]
        for k in set(a) & set(b):
            out += differences(a[k], b[k], tol, f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} != {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, tol, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float | int) and not isinstance(b, bool):
        same = (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= tol * max(1.0, abs(b))
        return [] if same else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# --- the entry points: (lm, generate's keyword arguments) -> the PROMPT row's record (a dict) ---


def via_generate(lm, kw: dict) -> dict:
    return lmtrace.generate(lm, PROMPT, **kw).to_dict()


def via_generate_list(lm, kw: dict) -> dict:
    """The prompt as the first row of a batch (sampled: see SHARED_DRAWS)."""
    return lmtrace.generate(lm, [PROMPT, OTHER], **kw)[0].to_dict()


def via_stream(lm, kw: dict) -> dict:
    return {"steps": [s.to_dict() for s in lmtrace.stream(lm, PROMPT, **kw)]}


def via_branch(lm, kw: dict) -> dict:
    """The original of a fan of 2 at step 1 (under a grammar that allows one token there, no branch)."""
    return lmtrace.branch(lm, PROMPT, at=1, fan=2, **kw).traces[0].to_dict()


def via_kvlab(lm, kw: dict) -> dict:
    return lmtrace.kvlab(lm, PROMPT, ["full"], **kw).reference.to_dict()


def registered_observers(kw: dict) -> dict[str, type]:
    """A JSON request cannot carry an Observer: the classes of the call's observers, registered
    by their names as an operator would (lmtrace serve / batch --observer NAME=module:Class)."""
    return {o.name: type(o) for o in kw.get("observers", ())}


def via_batch(lm, kw: dict) -> dict:
    """A batch job's line (the local engine, two lines decoded together) with the options as
    the line's own fields."""
    from lmtrace.batch.job import run_job
    from lmtrace.batch.local import local_engine

    if kw.get("logits_processors"):  # a JSON line names the processors the command registered
        kw = {**kw, "logits_processors": ["no_top_token"]}
    observers = registered_observers(kw)
    if observers:  # and the observers
        kw = {**kw, "observers": list(observers)}
    line = {"id": "a", "prompt": PROMPT, **kw}
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        lines = [line, {"id": "b", "prompt": OTHER, **kw}]
        src.write_text("\n".join(json.dumps(x, default=list) for x in lines) + "\n", encoding="utf-8")
        registered = {"logits_processors": {"no_top_token": no_top_token}, "observers": observers}
        run_job(src, out, local_engine(lambda: lm, registered, 2))
        records = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    record = records["a"]
    if "error" in record:
        raise InvalidParameter(record["error"])
    return record["trace"]


# --- the server: one app per draft setting (a draft is the server's: lmtrace serve --draft) ---

_APPS: dict[tuple, Any] = {}
# generate's keywords -> the request's fields (the server's names); the rest are sent as they are
REQUEST_NAMES = {"max_new_tokens": "max_tokens"}


class Refused(Exception):
    """An HTTP 400: the server's refusal, with its one line."""


def client(lm, kw: dict):
    from fastapi.testclient import TestClient

    from lmtrace.server import create_app

    observers = registered_observers(kw)
    key = (id(lm), kw.get("draft"), kw.get("draft_tokens"), tuple(observers.items()))
    if key not in _APPS:
        draft = {"draft": kw["draft"], "draft_tokens": kw["draft_tokens"]} if kw.get("draft") else {}
        # the processors and observers requests may name, registered as the operator would
        # (serve --logits-processor, --observer); requests may ask for the compiled step (serve --compile)
        processors = {"no_top_token": no_top_token}
        app = create_app(lm, **draft, logits_processors=processors, observers=observers, compile=True)
        _APPS[key] = TestClient(app)
    return _APPS[key]


# the OpenAI routes' spelling of a constraint: vLLM's structured_outputs
STRUCTURED = {"regex": "regex", "json_schema": "json", "choice": "choice"}


def request(lm, route: str, kw: dict, **fields: Any) -> dict:
    body = {REQUEST_NAMES.get(k, k): v for k, v in kw.items() if k not in ("draft", "draft_tokens")}
    if route != "/v1/traces":
        for name, field in STRUCTURED.items():
            if name in body:
                value = body.pop(name)
                body["structured_outputs"] = {field: list(value) if name == "choice" else value}
    if "logits_processors" in body:  # JSON names a processor the server registered (/v1/traces)
        body["logits_processors"] = ["no_top_token"]
    if "observers" in body:  # and the observers, by their names
        body["observers"] = list(registered_observers(kw))
    if "choice" in body:
        body["choice"] = list(body["choice"])
    body.update(fields)
    answer = client(lm, kw).post(route, json=body)
    if answer.status_code == 400:
        raise InvalidParameter(answer.json()["error"]["message"])
    assert answer.status_code == 200, answer.text
    return answer.json()


def via_traces(lm, kw: dict) -> dict:
    return request(lm, "/v1/traces", kw, prompt=PROMPT)


def _logprob_steps(
    tokens: list[int], logprobs: list[float], tops: list[list[float]], observed: list[dict] | None = None
) -> dict:
    """What an OpenAI answer tells of the steps: each token's raw logprob and its alternatives',
    and with the `observed` extension each step's observer entries."""
    steps = [{"logprob": lp, "top": [{"logprob": t} for t in top]} for lp, top in zip(logprobs, tops)]
    for step, entries in zip(steps, observed or []):
        step.update(entries or {})
    return {"steps": steps, "n": len(tokens)}


# the answer's `observed` extension: the observer fields a request sends (lmtrace.server.observed)
OBSERVED = ("lens", "attention", "uncertainty", "waterfall", "attribution")


def via_completions(lm, kw: dict) -> dict:
    n = kw.get("top_logprobs", 0)
    fields = {k: v for k, v in kw.items() if k != "top_logprobs"}
    answer = request(lm, "/v1/completions", fields, prompt=PROMPT, logprobs=n)
    got, skip = answer["choices"][0]["logprobs"], answer["usage"]["prompt_tokens"] if kw.get("echo") else 0
    # OpenAI's completions list the chosen token among the alternatives too: the n best are the n first
    tops = [sorted((x for x in (t or {}).values()), reverse=True)[:n] for t in got["top_logprobs"][skip:]]
    observed = (got.get("observed") or [])[skip:]
    return _logprob_steps(got["tokens"][skip:], got["token_logprobs"][skip:], tops, observed)


def via_chat(lm, kw: dict) -> dict:
    n = kw.get("top_logprobs", 0)
    fields = {k: v for k, v in kw.items() if k != "top_logprobs"}
    got = request(lm, "/v1/chat/completions", fields, messages=[{"role": "user", "content": PROMPT}],
                  logprobs=True, top_logprobs=n)["choices"][0]["logprobs"]["content"]  # fmt: skip
    tops = [[t["logprob"] for t in c["top_logprobs"]] for c in got]
    return _logprob_steps(got, [c["logprob"] for c in got], tops, [c.get("observed") for c in got])


def openai_view(trace: dict, names: tuple[str, ...] = ()) -> dict:
    """The reference as an OpenAI answer shows it (raw logprobs, alternatives in order, and the
    observer entries the `observed` extension carries: the built-in ones' and those `names`)."""
    steps = []
    for s in trace["steps"]:
        step = {"logprob": s["logprob"], "top": [{"logprob": a["logprob"]} for a in s["top"]]}
        step.update({k: s[k] for k in (*OBSERVED, *names) if k in s})
        steps.append(step)
    return {"steps": steps, "n": len(steps)}


ENTRIES: dict[str, Callable[[Any, dict], dict]] = {
    "generate": via_generate,
    "generate([...])": via_generate_list,
    "stream": via_stream,
    "branch": via_branch,
    "batch local": via_batch,
    "kv-lab reference": via_kvlab,
    "server /v1/traces": via_traces,
    "server completions": via_completions,
    "server chat": via_chat,
}


# entry points that decode rows together (a batch, the server's continuous batch): their numbers
# may differ from alone by the float noise of batched matrix products, and a batched generate's
# KV cache is the batch's (its `kv` and `kv_anatomy` say (2, ...))
BATCHED = {"generate([...])": ("kv", "kv_anatomy"), "batch local": (), "server /v1/traces": (),
           "server completions": (), "server chat": ()}  # fmt: skip
ALONE_TOL, BATCHED_TOL = 1e-6, 5e-5

# what each entry point refuses (in one line naming the option), beside what generate refuses
OBSERVERS = {"uncertainty", "attribution"}  # this round's observers
REFUSES = {
    "stream": {"echo"},  # a stream has no trace for the prompt's logprobs
    "branch": set(),
    "batch local": set(),
    "kv-lab reference": set(),
    "server /v1/traces": set(),
    "server completions": set(),
    "server chat": {"echo"},
}
# generate itself: the compiled step with hooks inside the forward (lens, attention, attribution)
GENERATE_REFUSES = [({"lens", "attention", "attribution"}, {"compile"})]
# an entry point's own pairs (a drafted branch, decode/branch_draft.py, takes what generate takes with a draft)
ENTRY_PAIR_REFUSES: dict[str, list[tuple[set[str], set[str]]]] = {
    "branch": [],
}
# (a drafted row of a continuous batch records its own forwards' lens, attention and attribution:
# "batch local" and the server's entries refuse no pair of their own)
# a drafted branch does not compile its draft's step yet (decode/branch.py DRAFTED_ALONE names compile)
ENTRY_PAIR_REFUSES["branch"].append(({"compile"}, set(DRAFTS)))
# --compile is an opt-in kernel path: within 5e-5 of the default path (its reference), its static
# cache's allocation and the names of what ran compiled aside
COMPILE_TOL = 5e-5


# sampled, a batched generate draws its rows from one generator, as model.generate does (so that
# from_generate reproduces its draws): its first row is not the lone draw; the cell checks that the
# same batch and seed give the same record again
SHARED_DRAWS = {("generate([...])", "seed")}


def refused_by(entry: str, features: tuple[str, ...]) -> set[str]:
    """The features of the cell that the entry point refuses (empty: the cell must work)."""
    f = set(features)
    out = f & REFUSES.get(entry, set())
    for a, b in GENERATE_REFUSES + ENTRY_PAIR_REFUSES.get(entry, []):
        if f & a and f & b:
            out |= f & (a | b)
    return out


def option_names(feature: str) -> list[str]:
    """The names a refusal of this feature may use: its keyword (a draft's `draft`)."""
    return [k for k in FEATURES[feature] if k not in BASE and k not in ("draft_tokens", "max_new_tokens", "seed")]


def uncompiled(record: dict) -> dict:
    """A compiled record without what names the compile (model.config.compile, params.compile)
    and the KV record (a static cache's allocation: tests/test_static_step.py checks it)."""
    record = {k: v for k, v in copy.deepcopy(record).items() if k != "kv_anatomy"}
    record.get("model", {}).get("config", {}).pop("compile", None)
    record.get("params", {}).pop("compile", None)
    for step in record.get("steps", []):
        step.pop("kv", None)
    return record


def outcome(lm, entry: str, features: tuple[str, ...], reference: dict, tol: float) -> str:
    """"ok", "refused: <the line>" or "WRONG: <how>" for one cell."""
    reference = copy.deepcopy(reference)
    kw = merged(*features)
    if any((entry, f) in SHARED_DRAWS for f in features):
        reference = ENTRIES[entry](lm, kw)
    try:
        got = ENTRIES[entry](lm, kw)
    except InvalidParameter as e:
        return f"refused: {e}"
    if entry == "stream":
        reference = {"steps": reference["steps"]}
    if entry == "server chat":  # the chat template around the prompt: the reference is generate's with chat
        reference = via_generate(lm, {**kw, "chat": True})
    if entry in ("server completions", "server chat"):
        reference = openai_view(reference, tuple(registered_observers(kw)))
    skip = BATCHED.get(entry, ())
    if "compile" in features:
        tol, got, reference = max(tol, COMPILE_TOL), uncompiled(got), uncompiled(reference)
    got, reference = ({k: v for k, v in d.items() if k not in skip} for d in (got, reference))
    for d in (got, reference):
        for step in d.get("steps", []):
            for k in skip:
                step.pop(k, None)
    found = differences(comparable(got), comparable(reference), tol)
    return "ok" if not found else "WRONG: " + "; ".join(sorted(found)[:4])
