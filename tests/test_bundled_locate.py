"""`locate="dtype:bfloat16"` (CLI `--locate`) on the bundled SmolLM2-135M: a trainer in bfloat16
flags tokens of clean float32 rollouts, locate picks the worst flagged one and names the first
layer where the two computations part; its per-layer relative differences equal a hand
computation with this test's own forward hooks within 1e-5. Cheap: two rollouts of 14 and 16
tokens whose engine logprobs are transformers' own float32 ones (a clean float32 engine at T = 1)."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.scoring.variants.worlds import cast
from tests.test_rollouts_formats import by_hand

pytestmark = pytest.mark.integration
TEXTS = [
    ("The capital of France is", " Paris, and the capital of Germany is a purple elephant who sings opera"),
    ("Once upon a time", ", in a kingdom of glass and thunder, a small frog counted the stars backwards"),
]


def engine_record(lm, k: int, prompt: str, completion: str) -> dict:
    """A rollout whose engine logprobs are one plain float32 forward's log-softmax."""
    p = list(lm.tokenizer(prompt)["input_ids"])
    c = list(lm.tokenizer(completion, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()  # (len(c), vocab)
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
    return {"id": f"r{k}", "prompt_ids": p, "completion_ids": c, "logprobs": logprobs.tolist()}


def test_locate_on_a_flagged_token_names_a_layer_as_hooks_say(bundled_lm):
    records = [engine_record(bundled_lm, k, p, c) for k, (p, c) in enumerate(TEXTS)]
    rep = lmtrace.rollouts(bundled_lm, records, trainer="dtype:bfloat16", locate="dtype:bfloat16")
    loc = rep["locate"]
    assert rep["summary"]["causes"] == [] and rep["summary"]["flagged"] > 0 and loc["flagged"] is True
    row = next(r for r in rep["rollouts"] if r["id"] == loc["rollout"])
    token = row["tokens"][loc["index"]]
    assert token["flagged"] and token["token_id"] == loc["token_id"]
    flagged = [t for r in rep["rollouts"] for t in r["tokens"] if t["flagged"]]
    gaps = [abs(t["engine_logprob"] - t["trainer_logprob"]) for t in flagged]
    assert abs(token["engine_logprob"] - token["trainer_logprob"]) == max(gaps)  # the worst flagged token

    record = next(r for r in records if r["id"] == loc["rollout"])
    ids = record["prompt_ids"] + record["completion_ids"][: loc["index"]]
    assert loc["position"] == len(ids) - 1
    ref, var = by_hand(bundled_lm.model, ids), by_hand(cast(bundled_lm.model, torch.bfloat16), ids)
    expected = [float((v - a).norm() / a.norm()) for a, v in zip(ref, var)]
    n = bundled_lm.model.config.num_hidden_layers
    assert [x["layer"] for x in loc["layers"]] == ["embed", *[f"L{i}" for i in range(n)], "norm", "lm_head"]
    for x, e in zip(loc["layers"], expected):
        assert abs(x["relative"] - e) <= 1e-5, (x, e)
    first = next(x["layer"] for x, e in zip(loc["layers"], expected) if e > loc["threshold"])
    assert loc["first_over"] == first
    jumps = [e - (expected[i - 1] if i else 0.0) for i, e in enumerate(expected)]
    assert loc["largest_jump"]["layer"] == loc["layers"][jumps.index(max(jumps))]["layer"]
