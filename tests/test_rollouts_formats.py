"""Each framework's rollout dump, written the way that framework writes it (TRL's and verl's
padded batch tensors .tolist(), vLLM's RequestOutput, an OpenAI-style response with token ids),
reads as the same rollouts as lmtrace's own format; and --locate's per-layer differences equal
a hand computation with forward hooks."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.scoring.rollouts import readers
from lmtrace.scoring.rollouts.locate import locate_at
from lmtrace.scoring.variants.worlds import cast
from tests import rollout_world as world

PAD = 1


@pytest.fixture(scope="module")
def records(tiny_lm):
    return world.clean(tiny_lm, seed=5, temperature=0.8)


def trl_batch(records):
    pw = max(len(r["prompt_ids"]) for r in records)
    cw = max(len(r["completion_ids"]) for r in records) + 2
    return {
        "prompt_ids": [[PAD] * (pw - len(r["prompt_ids"])) + r["prompt_ids"] for r in records],
        "prompt_mask": [[0] * (pw - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in records],
        "completion_ids": [r["completion_ids"] + [PAD] * (cw - len(r["completion_ids"])) for r in records],
        "completion_mask": [[1] * len(r["completion_ids"]) + [0] * (cw - len(r["completion_ids"])) for r in records],
        "sampling_per_token_logps": [r["logprobs"] + [0.0] * (cw - len(r["logprobs"])) for r in records],
        "temperature": 0.8, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    }  # fmt: skip


def verl_batch(records):
    t = trl_batch(records)
    return {"prompts": t["prompt_ids"], "responses": t["completion_ids"],
            "attention_mask": [p + c for p, c in zip(t["prompt_mask"], t["completion_mask"])],
            "rollout_log_probs": t["sampling_per_token_logps"], "uid": [f"q{i}" for i in range(len(records))],
            "meta_info": {"temperature": 0.8, "top_p": 1.0, "top_k": -1}}  # fmt: skip


def vllm_output(r, k):
    steps = [{str(t): {"logprob": lp, "rank": 3, "decoded_token": "x"}, str(t + 1): {"logprob": -9.0, "rank": 1}}
             for t, lp in zip(r["completion_ids"], r["logprobs"])]  # fmt: skip
    return {"request_id": str(k), "prompt": "...", "prompt_token_ids": r["prompt_ids"],
            "outputs": [{"index": 0, "text": "...", "token_ids": r["completion_ids"],
                         "cumulative_logprob": sum(r["logprobs"]), "logprobs": steps, "finish_reason": "length"}],
            "sampling_params": {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "min_p": 0.0}}  # fmt: skip


def openai_response(r, k, as_token):
    content = [({"token": f"token_id:{t}"} if as_token else {"token": "x", "token_id": t}) | {"logprob": lp,
               "bytes": [120], "top_logprobs": []} for t, lp in zip(r["completion_ids"], r["logprobs"])]  # fmt: skip
    return {"id": f"cmpl-{k}", "object": "text_completion", "prompt_token_ids": r["prompt_ids"],
            "choices": [{"index": 0, "text": "...", "logprobs": {"content": content}, "finish_reason": "length"}],
            "sampling": {"temperature": 0.8}}  # fmt: skip


def same(rollouts, records):
    assert [(r.prompt_ids, r.completion_ids, r.logprobs) for r in rollouts] == [
        (x["prompt_ids"], x["completion_ids"], x["logprobs"]) for x in records]
    assert all(r.params().temperature == 0.8 and r.params().top_k == 0 for r in rollouts)


def test_every_format_reads_the_same_rollouts(tiny_lm, records):
    same(readers.from_records([trl_batch(records)], "trl"), records)
    same(readers.from_records([verl_batch(records)], "verl"), records)
    same(readers.from_records([vllm_output(r, k) for k, r in enumerate(records)], "vllm"), records)
    for as_token in (True, False):
        same(readers.from_records([openai_response(r, k, as_token) for k, r in enumerate(records)], "openai"), records)
    rep = lmtrace.rollouts(tiny_lm, [verl_batch(records)], fmt="verl")
    assert [r["id"] for r in rep["rollouts"]] == ["q0/0", "q1/1", "q2/2"] and rep["summary"]["causes"] == []


def test_format_errors_name_the_field(records):
    bad = vllm_output(records[0], 0)
    bad["outputs"][0]["logprobs"][2] = {"7777": {"logprob": -1.0}}
    with pytest.raises(lmtrace.InvalidParameter, match=r"line 1: outputs\[0\].logprobs\[2\] has no entry for the"):
        readers.from_records([bad], "vllm")
    batch = trl_batch(records)
    del batch["sampling_per_token_logps"]
    with pytest.raises(lmtrace.InvalidParameter, match="line 1: sampling_per_token_logps is missing"):
        readers.from_records([batch], "trl")
    response = openai_response(records[0], 0, True)
    response["choices"][0]["logprobs"]["content"][0]["token"] = "hello"
    with pytest.raises(lmtrace.InvalidParameter, match=r"content\[0\].token carries no token id"):
        readers.from_records([response], "openai")


def by_hand(model, ids):
    """Each block's output by forward hooks of this test's own; the embedding, the final norm and
    the lm_head computed by calling those modules directly on them."""
    outs = []
    hooks = [layer.register_forward_hook(lambda _m, _a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0, -1]))
             for layer in model.model.layers]  # fmt: skip
    x = torch.tensor([ids])
    with torch.no_grad():
        model(input_ids=x, use_cache=False)
        for h in hooks:
            h.remove()
        embed = model.model.embed_tokens(x)[0, -1]
        normed = model.model.norm(outs[-1][None, None].to(model.model.norm.weight.dtype))[0, 0]
        last = model.lm_head(normed[None, None])[0, 0]
    return [v.float() for v in [embed, *outs, normed, last]]


def test_locate_equals_a_hand_computation_with_hooks(tiny_lm, records):
    r = readers.from_records(records)[1]
    ids = r.prompt_ids + r.completion_ids[:4]
    ref, var = by_hand(tiny_lm.model, ids), by_hand(cast(tiny_lm.model, torch.bfloat16), ids)
    # a zero vector (the pad token's embedding row) has no relative difference: 0, as locate says
    expected = [float((v - a).norm() / a.norm()) if a.norm() > 0 else 0.0 for a, v in zip(ref, var)]
    got = locate_at(tiny_lm, r, 4, lmtrace.scoring.variants.spec.parse_variant("dtype:bfloat16"), threshold=1e-3)
    assert [x["layer"] for x in got["layers"]] == ["embed", "L0", "L1", "norm", "lm_head"]
    for x, e in zip(got["layers"], expected):
        assert abs(x["relative"] - e) <= 1e-5, (x, e)
    first = next(x["layer"] for x, e in zip(got["layers"], expected) if e > 1e-3)
    assert got["first_over"] == first and got["position"] == len(ids) - 1
    jumps = [e - (expected[i - 1] if i else 0.0) for i, e in enumerate(expected)]
    assert got["largest_jump"]["layer"] == got["layers"][jumps.index(max(jumps))]["layer"]
