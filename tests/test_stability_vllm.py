"""`engine:vllm` in the stability ledger: vLLM on this CPU, float32, the same weights as the
reference. Its teacher-forced numbers (vLLM's prompt_logprobs) equal a plain transformers forward
within 1e-4, and its own greedy decoding diverges where model.generate does (nowhere, here)."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.scoring.stability.ledger import first_divergence
from tests.same_record import one_thread  # noqa: F401
from tests.vllm_world import needs_vllm, save_tiny_32

pytestmark = [*needs_vllm, pytest.mark.usefixtures("one_thread")]
TOL = 1e-4


@pytest.fixture(scope="module")
def lm32(tmp_path_factory, tiny_tok):
    folder = save_tiny_32(tiny_tok, tmp_path_factory.mktemp("tiny32-stability"))
    return lmtrace.load(str(folder), device="cpu", dtype="float32")


def test_engine_vllm_numbers_and_divergence(lm32):
    r = lmtrace.stability(lm32, "Once upon a time", ["engine:vllm", "batch:2"], temperature=0, max_new_tokens=8)
    v = r.variant("engine:vllm")
    assert v["status"] == "ran", v["reason"]
    assert "vLLM" in v["about"]
    ids, tokens = r.reference.prompt["token_ids"], r.reference.token_ids
    with torch.inference_mode():
        logits = lm32.model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    for s, x in zip(v["steps"], lp):
        assert abs(s["logprob"] - x) <= TOL and abs(s["delta"]) <= TOL and not s["flipped"]
    out = lm32.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, top_k=None, top_p=None,
                              eos_token_id=lm32.eos_token_ids, pad_token_id=lm32.pad_token_id)  # fmt: skip
    assert v["first_divergence"] == first_divergence(tokens, out[0, len(ids) :].tolist()) is None
    assert v["token_ids"] == tokens
    assert all(s["sigma"] is not None and s["sigma"] < 1e-3 for s in r.steps)
