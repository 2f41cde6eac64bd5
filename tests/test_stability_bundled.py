"""The stability ledger on the bundled SmolLM2-135M-Instruct (bounded: 8 tokens, one thread, two
variants): bfloat16 and a left-padded batch, each against an independent computation (the
variant's model loaded by lmtrace.load, or the batch built by hand, teacher-forced in a plain
forward) and model.generate under the variant. The packed variant is checked the same way on a
tiny GGUF (tests/test_stability.py): packing the bundled file twice costs more than it tells."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.decode.engine import left_pad, positions
from lmtrace.scoring.stability.ledger import first_divergence
from lmtrace.scoring.variants.spec import parse_variant
from lmtrace.scoring.variants.worlds import BatchWorld
from tests.same_record import one_thread  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]
PROMPT = "Write a haiku about autumn leaves."
TOKENS = 8


def forced(model, ids: list[int], first: int, tokens: list[int]) -> list[float]:
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, first - 1 : -1].float(), -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def generated(lm, model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=TOKENS, top_k=None, top_p=None,
                         eos_token_id=lm.eos_token_ids, pad_token_id=lm.pad_token_id)  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_bundled_variants_against_independent_computations(bundled_lm):
    lm = bundled_lm
    r = lmtrace.stability(lm, PROMPT, ["dtype:bfloat16", "batch:2"], chat=True, temperature=0, max_new_tokens=TOKENS)
    ids, tokens = r.reference.prompt["token_ids"], r.reference.token_ids
    full = ids + tokens
    base = forced(lm.model, full, len(ids), tokens)
    other = lmtrace.load(dtype="bfloat16").model
    v = r.variant("dtype:bfloat16")
    assert v["status"] == "ran", v["reason"]
    for s, x, b in zip(v["steps"], forced(other, full, len(ids), tokens), base):
        assert abs(s["logprob"] - x) <= 1e-4 and abs(s["delta"] - (x - b)) <= 1e-4, s
    assert v["first_divergence"] == first_divergence(tokens, generated(lm, other, ids))
    assert v["max_abs_delta"] > 1e-3  # a real change of precision, measured
    v = r.variant("batch:2")
    rows = [full, *BatchWorld(lm, parse_variant("batch:2")).others(len(full))]
    input_ids, mask = left_pad(rows, lm.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        logits = lm.model(input_ids=input_ids, attention_mask=mask, position_ids=positions(mask)).logits[0]
    pad = input_ids.shape[1] - len(full)
    lp = torch.log_softmax(logits[pad + len(ids) - 1 : -1].float(), -1)
    batched = lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    assert all(abs(s["logprob"] - x) <= 1e-4 for s, x in zip(v["steps"], batched))
    assert v["max_abs_delta"] < 1e-3 and v["first_divergence"] is None
    assert [s["index"] for s in r.steps] == list(range(len(tokens)))
