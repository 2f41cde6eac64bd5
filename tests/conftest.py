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


def pytest_report_header(config):
    """Whether the vLLM tests (marker `vllm`) can run here."""
    from tests.vllm_world import HAVE_VLLM

    return "vllm: installed, the vllm tests run" if HAVE_VLLM else "vllm: not installed, the vllm tests are skipped"
