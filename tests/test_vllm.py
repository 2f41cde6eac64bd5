"""vLLM as an engine, on the CPU, against lmtrace's own engine on the same weights (float32):
greedy token ids identical, text pieces byte-exact, logprobs within 1e-4; seeded sampling
checked for its distribution only (vLLM's sampler is not lmtrace's); `compare` says "raw" for
a raw-mode engine and "processed" for a processed-mode one; batch records, resume, render.
One vLLM engine per mode for the whole module (each start costs seconds)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

import lmtrace
from lmtrace.batch import defaults_of, run_job
from lmtrace.cli import main
from lmtrace.comparison import compare
from lmtrace.params import SamplingParams
from tests.same_record import by_id, one_thread, read_records  # noqa: F401
from tests.vllm_world import chat_response, needs_vllm, save_tiny_32

pytestmark = [*needs_vllm, pytest.mark.usefixtures("one_thread")]
KV = 64 << 20  # the tiny model's paged cache: 64 MiB
PROMPTS = ["Hello world", "很久很久以前，", "🙂 wörld, naïve café"]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny32_dir(tmp_path_factory, tiny_tok):
    return save_tiny_32(tiny_tok, tmp_path_factory.mktemp("tiny32"))


@pytest.fixture(scope="module")
def lm32(tiny32_dir):
    return lmtrace.load(str(tiny32_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def raw_engine(lm32, tiny32_dir):
    from lmtrace.vllm import VLLMEngine

    return VLLMEngine(lm32, tiny32_dir, logprobs_mode="raw", kv_cache_bytes=KV)


@pytest.fixture(scope="module")
def processed_engine(lm32, tiny32_dir):
    from lmtrace.vllm import VLLMEngine

    return VLLMEngine(lm32, tiny32_dir, logprobs_mode="processed", kv_cache_bytes=KV)


def write_prompts(path):
    lines = [json.dumps({"id": i, "prompt": p}, ensure_ascii=False) + "\n" for i, p in enumerate(PROMPTS)]
    path.write_text("".join(lines), encoding="utf-8")


def assert_steps_close(ours, theirs, tol=TOL):
    """Same tokens, pieces, bytes, ranks and alternatives; numbers within `tol`."""
    assert ours.token_ids == theirs.token_ids
    assert ours.text == theirs.text
    assert ours.finish_reason == theirs.finish_reason and ours.stop_reason == theirs.stop_reason
    for a, b in zip(ours.steps, theirs.steps):
        assert (a.token_id, a.text, a.bytes, a.rank) == (b.token_id, b.text, b.bytes, b.rank)
        for name in ("logprob", "sampled_logprob", "entropy", "sampled_entropy"):
            assert abs(getattr(a, name) - getattr(b, name)) <= tol, (a.index, name)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        for x, y in zip(a.top, b.top):
            assert abs(x.logprob - y.logprob) <= tol and abs(x.sampled_logprob - y.sampled_logprob) <= tol
        assert a.kv["seq_len"] == b.kv["seq_len"] == len(ours.prompt["token_ids"]) + a.index


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_greedy_equals_lmtrace(mode, lm32, raw_engine, processed_engine):
    engine = raw_engine if mode == "raw" else processed_engine
    params = SamplingParams(temperature=0, max_new_tokens=12, top_logprobs=4, repetition_penalty=1.3)
    theirs = engine.generate(PROMPTS, params)
    ours = [lmtrace.generate(lm32, p, params) for p in PROMPTS]  # alone: the kv of batch 1
    for a, b in zip(theirs, ours):
        assert_steps_close(a, b)
        assert "".join(s.text for s in a.steps) == lm32.tokenizer.decode(a.token_ids)
        engine_info = a.model["engine"]
        assert engine_info["logprobs_mode"] == f"{mode}_logprobs"
        assert engine_info["check"]["max_abs_diff"] <= TOL
        assert (a.origin, b.origin) == ("vllm", "lmtrace")
        assert lmtrace.Trace.from_json(a.to_json()).to_dict() == a.to_dict()


def test_stop_string_and_end_token(lm32, raw_engine):
    greedy = lmtrace.generate(lm32, "Once upon", temperature=0, max_new_tokens=10)
    stop = greedy.steps[4].text or greedy.steps[5].text
    for kwargs in ({"stop": [stop]}, {"stop_on_eos": False}):
        params = SamplingParams(temperature=0, max_new_tokens=10, **kwargs)
        assert_steps_close(raw_engine.generate("Once upon", params), lmtrace.generate(lm32, "Once upon", params))


def test_kv_from_vllm_blocks(raw_engine, lm32):
    trace = raw_engine.generate("Hello", temperature=0, max_new_tokens=4)
    header = trace.model["engine"]["kv"]
    assert header["block_size"] and header["num_blocks"]
    per_token = 2 * 2 * 2 * 32 * 4  # keys and values x layers x kv heads x head_dim x float32
    assert header["bytes_per_block"] == header["block_size"] * per_token
    for step in trace.steps:
        kv = step.kv
        assert kv["bytes_used"] == kv["expected_bytes"] == kv["seq_len"] * per_token
        assert kv["blocks"]["count"] == math.ceil(kv["seq_len"] / header["block_size"])
        assert kv["bytes"] == kv["blocks"]["count"] * header["bytes_per_block"]


def test_echo_prompt_logprobs(lm32, raw_engine):
    theirs = raw_engine.generate(PROMPTS[1], temperature=0, max_new_tokens=3, top_logprobs=3, echo=True)
    ours = lmtrace.generate(lm32, PROMPTS[1], temperature=0, max_new_tokens=3, top_logprobs=3, echo=True)
    assert len(theirs.prompt_logprobs) == len(ours.prompt_logprobs) == len(ours.prompt["token_ids"])
    for a, b in zip(theirs.prompt_logprobs[1:], ours.prompt_logprobs[1:]):
        assert (a.token_id, a.text, a.rank) == (b.token_id, b.text, b.rank)
        assert abs(a.logprob - b.logprob) <= TOL and abs(a.entropy - b.entropy) <= TOL
        assert [c.token_id for c in a.top] == [c.token_id for c in b.top]


def test_seeded_sampling_follows_the_model(lm32, raw_engine, processed_engine):
    """First tokens of 400 seeded draws against the model's own probabilities; with top_k the
    draws stay inside the top k, and the processed numbers are those of the filtered distribution."""
    n = 400
    params = [SamplingParams(temperature=1.0, max_new_tokens=1, seed=s, top_logprobs=0) for s in range(n)]
    traces = raw_engine.generate_each(["Hello world"] * n, params)
    counts = Counter(t.token_ids[0] for t in traces)
    probs = {t.token_ids[0]: math.exp(t.steps[0].logprob) for t in traces}
    for token, p in sorted(probs.items(), key=lambda kv: -kv[1])[:3]:
        assert abs(counts[token] / n - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9, (token, counts[token], p)
    again = raw_engine.generate_each(["Hello world"] * 8, params[:8])
    assert [t.token_ids for t in again] == [t.token_ids for t in traces[:8]]  # a seed is a seed
    filtered = SamplingParams(temperature=0.7, top_k=3, max_new_tokens=8, seed=11, top_logprobs=3)
    for engine in (raw_engine, processed_engine):
        trace = engine.generate("Hello world", filtered)
        assert all(s.rank <= 3 and math.isfinite(s.sampled_logprob) for s in trace.steps)
        assert trace.model["engine"]["check"]["max_abs_diff"] <= TOL


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_compare_verdict(mode, lm32, raw_engine, processed_engine):
    from lmtrace.vllm.params import to_vllm

    engine = raw_engine if mode == "raw" else processed_engine
    params = SamplingParams(temperature=0.5, max_new_tokens=16, seed=3, top_logprobs=3)
    ids = lm32.tokenizer(PROMPTS[0])["input_ids"]
    result = engine.llm.generate([{"prompt_token_ids": ids}], [to_vllm(params, lm32.eos_token_ids)], use_tqdm=False)
    response = chat_response(result[0], lm32.tokenizer, prompt=PROMPTS[0])
    verdict = compare(lm32, response, temperature=0.5).summary
    assert verdict["verdict"] == mode, verdict


def test_batch_records_and_resume(tmp_path, lm32, raw_engine):
    from lmtrace.batch.vllm_engine import trace_lines_vllm

    lines = [
        {"id": "a", "prompt": PROMPTS[0]},
        {"id": 2, "prompt": PROMPTS[1], "temperature": 0.8, "seed": 5},
        {"id": "bad", "prompt": "x", "top_p": 2},
        {"id": "msg", "messages": [{"role": "user", "content": "hi"}]},  # no chat template: an error line
        {"id": "c", "prompt": PROMPTS[2], "max_new_tokens": 3},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    defaults = defaults_of(SamplingParams(temperature=0, max_new_tokens=6, top_logprobs=2))

    def engine(pending, on_tokens):
        return trace_lines_vllm(raw_engine, pending, defaults, 2, on_tokens)

    first = run_job(src, out, engine)
    assert (first.written, first.errors) == (5, 2)
    records = by_id(read_records(out))
    assert records["bad"]["error"] == "top_p must be in (0, 1], got 2.0"
    assert "error" in records["msg"]
    local = lmtrace.generate(lm32, PROMPTS[0], temperature=0, max_new_tokens=6, top_logprobs=2)
    assert records["a"]["trace"]["token_ids"] == local.token_ids
    assert records[2]["trace"]["params"]["seed"] == 5
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 40])  # a job killed while writing its last line
    second = run_job(src, out, engine)
    assert (second.already_done, second.written, second.repaired_bytes > 0) == (4, 1, True)
    again = by_id(read_records(out))
    assert set(again) == set(records) and again["a"] == records["a"]
    assert run_job(src, out, engine).written == 0


def test_cli_batch_and_render(tmp_path, tiny32_dir, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_prompts(src)
    args = ["--model", str(tiny32_dir), "--temperature", "0", "--max-new-tokens", "5", "--dtype", "float32"]
    assert main(["batch", str(src), str(out), "--engine", "vllm", "--kv-cache-gib", "0.0625", *args]) == 0
    local = tmp_path / "local.jsonl"
    assert main(["batch", str(src), str(local), *args]) == 0
    ours, theirs = by_id(read_records(local)), by_id(read_records(out))
    for i in range(len(PROMPTS)):
        assert theirs[i]["trace"]["token_ids"] == ours[i]["trace"]["token_ids"]
        assert theirs[i]["trace"]["text"] == ours[i]["trace"]["text"]
    one = tmp_path / "one.json"
    one.write_text(json.dumps(theirs[1]["trace"], ensure_ascii=False), encoding="utf-8")
    assert main(["render", str(one), "--no-color"]) == 0
    assert main(["render", str(one), "--html", str(tmp_path / "one.html")]) == 0
    assert "很久很久以前" in (tmp_path / "one.html").read_text(encoding="utf-8")
    capsys.readouterr()
    assert main(["batch", str(src), str(out), "--engine", "vllm", *args]) == 0  # resumes: nothing to do
    assert "already in" in capsys.readouterr().err


def test_a_model_vllm_cannot_run(tmp_path, tiny_dir, capsys):
    """tests/tiny.py's model has head_dim 16, below what vLLM's CPU attention supports."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "Hello"}\n')
    code = main(["batch", str(src), str(tmp_path / "out.jsonl"), "--engine", "vllm", "--model", str(tiny_dir),
                 "--kv-cache-gib", "0.0625"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("lmtrace: error: model: vLLM cannot run"), err[-3:]


@pytest.mark.integration
def test_bundled_model_exported_to_a_folder(bundled_lm):
    """The bundled GGUF, written to a folder in lmtrace's cache (lmtrace.model.folder.save_folder) and run by vLLM."""
    from lmtrace.vllm import VLLMEngine

    engine = VLLMEngine.start(bundled_lm, None, kv_cache_bytes=256 << 20, max_model_len=512)
    params = SamplingParams(temperature=0, max_new_tokens=12, top_logprobs=5)
    prompts = ["很久很久以前，", "The capital of France is"]
    for theirs, prompt in zip(engine.generate(prompts, params), prompts):
        assert_steps_close(theirs, lmtrace.generate(bundled_lm, prompt, params))
        assert theirs.model["engine"]["check"]["max_abs_diff"] <= TOL


# a Ray cluster and a vLLM replica in its own process (~45 s on 2 idle cores): `make test-slow`; `make test`
# keeps --engine vllm (test_cli_batch_and_render) and Ray's actor pool (tests/test_batch_ray.py)
@pytest.mark.slow
def test_on_ray(tmp_path, tiny32_dir, raw_engine):
    """--engine vllm with --num-workers: a vLLM replica in a Ray Data actor on a local Ray."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'lmtrace[ray]')")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_prompts(src)
    args = ["--model", str(tiny32_dir), "--temperature", "0", "--max-new-tokens", "4", "--kv-cache-gib", "0.0625"]
    assert main(["batch", str(src), str(out), "--engine", "vllm", "--num-workers", "1", *args]) == 0
    records = by_id(read_records(out))
    here = raw_engine.generate(PROMPTS, temperature=0, max_new_tokens=4)
    assert [records[i]["trace"]["token_ids"] for i in range(len(PROMPTS))] == [t.token_ids for t in here]
    assert records[0]["trace"]["model"]["engine"]["name"] == "vllm"


def test_batch_lines_vllm_cannot_run_are_refused(tmp_path, raw_engine):
    """A line asking for what only lmtrace's engine runs gets its error line, never a trace
    without it (the options were dropped silently before)."""
    from lmtrace.batch.vllm_engine import trace_lines_vllm

    lines = [{"id": "lens", "prompt": PROMPTS[0], "lens": True},
             {"id": "att", "prompt": PROMPTS[0], "attention": "heads"},
             {"id": "draft", "prompt": PROMPTS[0], "draft": "layers:1"},
             {"id": "unc", "prompt": PROMPTS[0], "uncertainty": True}]  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    defaults = defaults_of(SamplingParams(temperature=0, max_new_tokens=4))
    done = run_job(src, out, lambda pending, on_tokens: trace_lines_vllm(raw_engine, pending, defaults, 4, on_tokens))
    assert (done.written, done.errors) == (4, 4)
    records = by_id(read_records(out))
    for key, name in (("lens", "lens"), ("att", "attention"), ("draft", "draft"), ("unc", "uncertainty")):
        assert records[key]["error"] == f"{name}: the vllm engine does not run {name}; use --engine local"
