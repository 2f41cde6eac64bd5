from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from lmtrace.model.lm import LM  # noqa: E402
from lmtrace.model.load import load  # noqa: E402  (the real one, also where shared_bundled stands in)
from tests.tiny import tiny_model, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_lm(tiny_tok) -> LM:
    return LM.from_objects(tiny_model(tiny_tok), tiny_tok, source="tiny")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_lm):
    """The tiny model saved as a Hugging Face folder (safetensors), for load() and the CLI."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_lm.model.save_pretrained(path)
    tiny_lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bundled_lm() -> LM:
    return load()


@pytest.fixture(scope="session")
def bundled_packed() -> LM:
    """The bundled model on its GGUF's own 4-bit weights (`load(weights="packed")`), loaded once."""
    return load(weights="packed")


# what a load may ask for and still be the session's bundled model: no source, float32 on the CPU
_PLAIN_LOAD = {"device": ("auto", "cpu"), "dtype": ("auto", "float32"), "trust_remote_code": (False,),
               "allow_pickle": (False,), "device_map": (None,), "gguf_cache": (True,),
               "weights": ("float", "packed"), "matmul": ("default",)}  # fmt: skip


@pytest.fixture
def shared_bundled(request, monkeypatch):
    """lmtrace.load of the bundled model, as a test's CLI command or docs block asks for it (no
    source, float32 on the CPU, float or packed weights), returns the session's bundled_lm or
    bundled_packed: the same real model, loaded once for the whole suite instead of once per
    command. Any other load is the real one. The CLI's own loading of the bundled model is tested
    elsewhere (tests/test_bundled.py, tests/test_gguf_cache.py, the subprocess tests)."""
    import torch

    import lmtrace
    from lmtrace.model import load as loading

    def shared(source=None, options=None, **kwargs):
        if options is not None:  # a LoadOptions whole: the real load
            return load(source, options, **kwargs)
        asked = {k: v for k, v in kwargs.items() if k != "status"}  # status: told nothing, nothing is loaded
        plain = all(v in _PLAIN_LOAD.get(k, ()) for k, v in asked.items())
        if source is None and plain and not torch.cuda.is_available():
            packed = asked.get("weights", "float") == "packed"
            return request.getfixturevalue("bundled_packed" if packed else "bundled_lm")
        return load(source, **kwargs)

    monkeypatch.setattr(loading, "load", shared)
    monkeypatch.setattr(lmtrace, "load", shared)
    return shared


@pytest.fixture(scope="session")
def bundled_server(tmp_path_factory):
    """`lmtrace serve` of the bundled model, started once for the suite and shared by the tests
    that talk to it (tests/audit/, tests/server/: each start costs a process, torch's imports and a
    load); its log to a file: a pipe nobody reads would fill."""
    import subprocess
    import sys
    import time

    import httpx

    from tests.server.process import SRC, free_port

    port = free_port()
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", "from lmtrace.cli import entry; entry()", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, "lmtrace serve exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "lmtrace serve did not start"
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(30)
    log.close()


@pytest.fixture(scope="session")
def bundled_vllm(bundled_lm):
    """One vLLM engine on the bundled model for the whole session (a start costs 10-30 s on a
    CPU), shared by the tests that run vLLM on it: float32, processed logprobs (those of the
    distribution the sampler drew from), xgrammar compiling JSON compact as lmtrace does."""
    from tests.vllm_world import HAVE_VLLM

    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (pip install 'lmtrace[vllm]', see the README)")
    from lmtrace.vllm import VLLMEngine

    return VLLMEngine.start(
        bundled_lm,
        None,
        logprobs_mode="processed",
        kv_cache_bytes=256 << 20,
        max_model_len=512,
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )


def pytest_report_header(config):
    """Whether the vLLM tests (marker `vllm`) can run here."""
    from tests.vllm_world import HAVE_VLLM

    return "vllm: installed, the vllm tests run" if HAVE_VLLM else "vllm: not installed, the vllm tests are skipped"
