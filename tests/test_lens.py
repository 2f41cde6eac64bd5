"""The logit lens is exact: every layer's row is the model's own final norm and unembedding
(and soft-capping) over that layer's residual stream, the last row is the step's own
distribution, and turning the lens on changes no token and no logprob."""

from __future__ import annotations

import pytest
import torch

import lmtrace
from lmtrace.inside import lens
from tests.tiny_archs import ARCHS, final_head, tiny_arch

PROMPTS = ["Hello world, the quick", "很久很久以前，"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_lm(request, tiny_tok):
    return request.param, tiny_arch(request.param, tiny_tok)


def _manual(arch: str, model, h: torch.Tensor) -> torch.Tensor:
    """lm_head(norm(h)) (+ soft-cap) written out by hand: float32 logprobs."""
    norm, weight, cap = final_head(arch, model)
    logits = norm(h) @ weight.T
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits.float(), -1)


def test_hooks_read_hidden_states_and_the_norm_is_applied_once(arch_lm):
    arch, lm = arch_lm
    ids = torch.tensor([lmtrace.encode_prompt(lm, PROMPTS[0])])
    un = lens.unembedding(lm.model)
    with torch.no_grad(), lens.capturing(lm.model) as rows:
        out = lm.model(ids, output_hidden_states=True)
    hs = out.hidden_states  # embeddings, layer 1 .. layer L-1 outputs, the final *normed* output
    assert len(rows) == len(hs) == lm.model.config.num_hidden_layers + 1
    for n in range(len(rows) - 1):
        assert torch.equal(rows[n], hs[n][:, -1])
        mine = torch.log_softmax(un.logits(rows[n]), -1)
        assert (mine - _manual(arch, lm.model, hs[n][:, -1])).abs().max() < 1e-6
    # transformers 5.x: the last hidden state is already normed; the lens norms the raw output once
    # (probabilities: a logprob near -20 is a few float32 steps of 2e-6 apart)
    final = torch.softmax(out.logits[:, -1].float(), -1)
    assert (torch.softmax(un.logits(rows[-1]), -1) - final).abs().max() < 1e-6
    assert (_manual(arch, lm.model, rows[-1]).exp() - final).abs().max() < 1e-6
    if arch in ("gemma2", "gpt2"):
        assert un.describe()["tied_embeddings"] and "tied" in un.describe()["unembedding"]
    assert un.describe()["softcap"] == (3.0 if arch == "gemma2" else None)


def test_lens_rows_match_a_manual_lens_at_every_step(arch_lm):
    arch, lm = arch_lm
    traces = lmtrace.generate(lm, PROMPTS, max_new_tokens=5, temperature=0, top_logprobs=3, lens=True)
    for trace in traces:
        ids = trace.prompt["token_ids"] + trace.token_ids
        with torch.no_grad():
            hs = lm.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for i, step in enumerate(trace.steps):
            layers = step.lens["layers"]
            assert [x["layer"] for x in layers] == list(range(len(hs)))
            q = len(trace.prompt["token_ids"]) + i - 1  # the position whose forward gave step i
            for n, rec in enumerate(layers[:-1]):
                lp = _manual(arch, lm.model, hs[n][0, q])
                assert rec["chosen_logprob"] == pytest.approx(lp[step.token_id].item(), abs=1e-5)
                assert rec["chosen_rank"] == int((lp > lp[step.token_id]).sum()) + 1
                assert [t["token_id"] for t in rec["top"]] == torch.topk(lp, 3).indices.tolist()
                assert rec["entropy"] == pytest.approx(-(lp.exp() * lp).sum().item(), abs=1e-4)
            last = layers[-1]  # the final layer's row is the step's own distribution
            assert last["chosen_logprob"] == step.logprob and last["chosen_rank"] == step.rank
            assert [t["token_id"] for t in last["top"]] == [a.token_id for a in step.top]
            assert last["kl_to_final"] == 0.0 and last["entropy"] == pytest.approx(step.entropy, abs=1e-6)
            assert all(x["kl_to_final"] >= 0 for x in layers)


def test_lens_changes_no_token_and_no_logprob(arch_lm):
    _, lm = arch_lm
    kw = dict(max_new_tokens=6, temperature=0.9, seed=3, top_logprobs=2)
    plain = lmtrace.generate(lm, PROMPTS, **kw)
    seen = lmtrace.generate(lm, PROMPTS, **kw, lens=True)
    for a, b in zip(plain, seen):
        assert a.token_ids == b.token_ids
        assert [s.logprob for s in a.steps] == [s.logprob for s in b.steps]
        assert [s.sampled_logprob for s in a.steps] == [s.sampled_logprob for s in b.steps]
        assert b.params["lens"]["norm"] in ("norm", "ln_f")


def test_settling_layer():
    rows = [[1, 7], [1, 5], [1, 7], [1, 7]]  # (rank, top-1) per layer
    assert lens.settled(rows, 7) == 2
    assert lens.settled(rows, 5) is None
    assert lens.settled([[1, 7]] * 3, 7) == 0


def test_lens_record_round_trips_and_names_tokens(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=3, temperature=0, lens=True)
    step = trace.steps[0]
    assert len(step.lens["layers"][0]["top"]) == 5  # top_logprobs 0: five per layer
    top = step.lens["layers"][1]["top"][0]
    assert list(top) == ["token_id", "text", "logprob"]
    assert top["text"] == tiny_lm.tokenizer.decode([top["token_id"]]) or "\ufffd" in top["text"]
    back = lmtrace.Trace.from_json(trace.to_json())
    assert back.steps[0].lens == step.lens and back.to_dict() == trace.to_dict()
    plain = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=3, temperature=0)
    assert "lens" not in plain.to_dict()["steps"][0] and "lens" not in plain.params


def test_lens_streams(tiny_lm):
    steps = list(lmtrace.stream(tiny_lm, "Hello", max_new_tokens=3, temperature=0, lens=True))
    assert all(s.lens is not None and s.attention is None for s in steps)
