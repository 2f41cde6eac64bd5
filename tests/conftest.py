from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from lmtrace.model.lm import LM  # noqa: E402
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
    import lmtrace

    return lmtrace.load()


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
