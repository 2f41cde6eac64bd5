"""The logit lens and attention on the bundled SmolLM2-135M (30 layers, GQA 9/3): the same
tokens and logprobs bit for bit with both on, the final lens row is the step's distribution,
the other rows equal a manual norm + lm_head over transformers' hidden states, and the
attention weights equal eager attention's at absolute positions."""

from __future__ import annotations

import copy

import pytest
import torch

import lmtrace

pytestmark = pytest.mark.integration
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def pair(bundled_lm):
    kw = dict(max_new_tokens=6, temperature=0, top_logprobs=5)
    return lmtrace.generate(bundled_lm, PROMPT, **kw), lmtrace.generate(bundled_lm, PROMPT, **kw, lens=True,
                                                                        attention=True)  # fmt: skip


def test_both_on_change_nothing_and_the_final_row_is_the_step(pair):
    plain, seen = pair
    assert seen.token_ids == plain.token_ids
    assert [s.logprob for s in seen.steps] == [s.logprob for s in plain.steps]
    assert [[a.logprob for a in s.top] for s in seen.steps] == [[a.logprob for a in s.top] for s in plain.steps]
    for s in seen.steps:
        last = s.lens["layers"][-1]
        assert len(s.lens["layers"]) == 31 and len(s.attention["layers"]) == 30
        assert abs(last["chosen_logprob"] - s.logprob) <= 1e-6 and last["chosen_rank"] == s.rank
        assert [t["token_id"] for t in last["top"]] == [a.token_id for a in s.top]
    assert seen.params["lens"]["tied_embeddings"] is True  # SmolLM2 ties lm_head to embed_tokens


def test_lens_rows_and_attention_equal_transformers(bundled_lm, pair):
    _, seen = pair
    i = 3
    ids = seen.prompt["token_ids"] + seen.token_ids[:i]  # the forward that produced step i
    model = copy.deepcopy(bundled_lm.model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    step = seen.steps[i]
    head = model.get_output_embeddings().weight
    for n in (0, 10, 29):
        lp = torch.log_softmax((model.model.norm(out.hidden_states[n][0, -1]) @ head.T).float(), -1)
        rec = step.lens["layers"][n]
        assert rec["chosen_logprob"] == pytest.approx(lp[step.token_id].item(), abs=1e-4)
        assert [t["token_id"] for t in rec["top"]] == torch.topk(lp, 5).indices.tolist()
    for layer in (0, 15, 29):
        want = out.attentions[layer][0, :, -1, :].mean(0)  # (heads, q, kv) -> (kv,)
        rec = step.attention["layers"][layer]
        for t in rec["top"]:
            assert t["weight"] == pytest.approx(want[t["position"]].item(), abs=1e-5)
            assert t["token_id"] == ids[t["position"]]
        assert [t["position"] for t in rec["top"]] == torch.topk(want, 5).indices.tolist()
        assert rec["sink_mass"] == pytest.approx(want[:4].sum().item(), abs=1e-5)
