"""Interventions traced: strength 0 is the reference to the bit; a cached intervened generation
equals a full recompute under the same intervention; ablating a head or a block matches the
same ablation written by hand (zeroed weights on a copy of the model); the arms' numbers, the
steering vector, the CLI and bad input."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import lmtrace
from lmtrace.cli import main
from lmtrace.errors import InvalidParameter
from lmtrace.inside import intervene as hooks
from lmtrace.interventions import intervene, steer_vector
from lmtrace.interventions.arms import forced_logits, parse_patch
from lmtrace.interventions.vectors import save_vector
from tests.cli_errors import one_error

PROMPT = "Hello world, the"


@pytest.fixture(scope="module")
def vector_file(tmp_path_factory, tiny_lm):
    path = tmp_path_factory.mktemp("steer") / "v.pt"
    torch.manual_seed(1)
    save_vector(path, torch.randn(tiny_lm.model.config.hidden_size), 0, {})
    return path


def test_strength_zero_is_the_reference_to_the_bit(tiny_lm, vector_file):
    plain = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=6, temperature=1.0, seed=5)
    with hooks.applied(tiny_lm.model, [hooks.parse_steer(f"1:{vector_file}:0", tiny_lm.model)]):
        zero = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=6, temperature=1.0, seed=5)
    assert zero.token_ids == plain.token_ids
    assert [s.logprob for s in zero.steps] == [s.logprob for s in plain.steps]
    assert [[a.logprob for a in s.top] for s in zero.steps] == [[a.logprob for a in s.top] for s in plain.steps]
    result = intervene(tiny_lm, PROMPT, steer=[f"1:{vector_file}:0"], max_new_tokens=6, temperature=0)
    arm = result.arms[0]
    assert all(s["delta"] == 0.0 and s["kl"] == 0.0 for s in arm["steps"])
    assert arm["free"]["first_divergence"] is None and arm["summary"]["divergence_step"] is None


@pytest.mark.parametrize("spec", ["0.h1", "1.attn", "0.mlp", "steer:1:3.0", "patch:0:Once upon a time"])
def test_cached_intervened_run_equals_full_recompute(tiny_lm, vector_file, spec):
    model = tiny_lm.model
    if spec.startswith("patch:"):
        change = parse_patch(tiny_lm, spec[6:], lmtrace.encode_prompt(tiny_lm, PROMPT))
    elif spec.startswith("steer:"):
        layer, alpha = spec.split(":")[1:]
        change = hooks.parse_steer(f"{layer}:{vector_file}:{alpha}", model)
    else:
        change = hooks.parse_ablate(spec, model)
    with hooks.applied(model, [change]):
        trace = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=8, temperature=0, stop_on_eos=False)
    ids = lmtrace.encode_prompt(tiny_lm, PROMPT)
    full = torch.log_softmax(forced_logits(tiny_lm, ids, list(trace.token_ids), [change]), -1)
    for step, lp in zip(trace.steps, full):
        assert step.token_id == int(lp.argmax())
        assert step.logprob == pytest.approx(float(lp[step.token_id]), abs=1e-5)
        for alt in step.top:
            assert alt.logprob == pytest.approx(float(lp[alt.token_id]), abs=1e-5)


def _zeroed_copy(model, layer: int, head: int | None):
    """The same ablation by hand: a copy whose o_proj columns of that head (or whole o_proj) are 0."""
    other = copy.deepcopy(model)
    o = other.model.layers[layer].self_attn.o_proj
    width = o.weight.shape[1] // model.config.num_attention_heads
    with torch.no_grad():
        if head is None:
            o.weight.zero_()
        else:
            o.weight[:, head * width : (head + 1) * width] = 0
    return other


@pytest.mark.parametrize("layer, head", [(0, 2), (1, 0), (1, None)])
def test_ablation_matches_a_hand_written_one(tiny_lm, layer, head):
    model = tiny_lm.model
    seq = torch.tensor([lmtrace.encode_prompt(tiny_lm, PROMPT + " quick brown fox")])
    spec = f"{layer}.attn" if head is None else f"{layer}.h{head}"
    with torch.no_grad(), hooks.applied(model, [hooks.parse_ablate(spec, model)]):
        ours = model(seq).logits
    with torch.no_grad():
        hand = _zeroed_copy(model, layer, head)(seq).logits
        plain = model(seq).logits
    assert torch.allclose(ours, hand, atol=1e-5)
    assert not torch.allclose(ours, plain, atol=1e-3)  # the ablation did change something

    def drop(m, args):  # the test's own forward-hook ablation of that head
        x = args[0].clone()
        w = x.shape[-1] // model.config.num_attention_heads
        x[..., head * w : (head + 1) * w] = 0
        return (x,)

    if head is not None:
        handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(drop)
        with torch.no_grad():
            theirs = model(seq).logits
        handle.remove()
        assert torch.equal(ours, theirs)


def test_patching_the_prompt_with_itself_is_the_reference_and_another_moves_it(tiny_lm):
    same = intervene(tiny_lm, PROMPT, patch=[f"1:{PROMPT}"], max_new_tokens=5, temperature=0)
    # the source's residual comes from a forward of another length: equal to rounding, not to the bit
    assert all(abs(s["delta"]) < 1e-5 and s["kl"] < 1e-6 for s in same.arms[0]["steps"])
    assert same.arms[0]["free"]["first_divergence"] is None
    other = intervene(tiny_lm, PROMPT, patch=["1:Once upon a time there"], max_new_tokens=5, temperature=0)
    assert other.arms[0]["steps"][0]["kl"] > 0  # the last prompt position feeds step 0 directly
    assert other.arms[0]["kind"] == "patch"


def test_arms_numbers_and_shape(tiny_lm, vector_file):
    result = intervene(tiny_lm, PROMPT, ablate=["1.mlp", "0.h3"], steer=[f"1:{vector_file}:4"],
                       max_new_tokens=6, temperature=0, stop_on_eos=False)  # fmt: skip
    d = json.loads(result.to_json())
    assert set(d) >= {"reference", "arms"} and len(d["arms"]) == 3
    ref = d["reference"]
    for arm in d["arms"]:
        assert set(arm) >= {"intervention", "steps", "summary", "free"}
        assert set(arm["summary"]) >= {"mean_kl", "max_kl", "top1_agreement", "divergence_step"}
        assert set(arm["free"]) >= {"text", "first_divergence"}
        for s, r in zip(arm["steps"], ref["steps"]):
            assert s["token_id"] == r["token_id"]
            assert s["delta"] == pytest.approx(s["logprob"] - r["logprob"], abs=1e-4)
            assert s["kl"] >= 0
        kls = [s["kl"] for s in arm["steps"]]
        assert arm["summary"]["max_kl"] == max(kls)
        free = arm["free"]
        div = free["first_divergence"]
        assert free["token_ids"][:div] == ref["token_ids"][:div]
        if div is not None:
            assert free["token_ids"][div] != ref["token_ids"][div]
    assert max(a["summary"]["max_kl"] for a in d["arms"]) > 0


def test_steer_vector_is_the_mean_difference(tiny_lm):
    pos, neg = ["Hello world", "the quick fox"], ["Once upon a time"]
    vec = steer_vector(tiny_lm, pos, neg, 0)

    def mean_after(text):
        out = tiny_lm.model(torch.tensor([tiny_lm.tokenizer(text)["input_ids"]]), output_hidden_states=True)
        return out.hidden_states[1][0].mean(0)  # hidden_states[i + 1]: after decoder layer i (not the last)

    with torch.no_grad():
        hand = torch.stack([mean_after(t) for t in pos]).mean(0) - torch.stack([mean_after(t) for t in neg]).mean(0)
    assert torch.allclose(vec, hand, atol=1e-5)


@pytest.mark.parametrize("kw, message", [
    ({"ablate": ["2.attn"]}, "ablate: layer must be in 0..1"),
    ({"ablate": ["0.h4"]}, "ablate: head must be in 0..3"),
    ({"ablate": ["0.ffn"]}, "ablate must be L.attn, L.mlp or L.hH"),
    ({"steer": [(0, torch.zeros(10), 1.0)]}, "steer: the vector is 10 wide, the model's residual 64"),
    ({"steer": ["5:v.pt:1"]}, "steer: layer must be in 0..1"),
    ({"steer": ["0:/no/such.pt:1"]}, "steer: cannot read the vector file"),
    ({"steer": ["0:v.pt:x"]}, "steer: alpha must be a number"),
    ({"patch": ["7:Hello"]}, "patch: layer must be in 0..1"),
    ({"patch": ["1"]}, "patch must be L:TEXT"),
    ({}, "needs at least one --ablate, --steer or --patch"),
])  # fmt: skip
def test_bad_input_is_one_named_error(tiny_lm, kw, message):
    with pytest.raises(InvalidParameter, match=message):
        intervene(tiny_lm, PROMPT, max_new_tokens=2, **kw)


def test_cli_steer_vector_and_intervene(capsys, tiny_dir, tmp_path):
    vec = tmp_path / "v.pt"
    code = main(["steer-vector", "--model", str(tiny_dir), "--positive", "Hello world", "--negative", "Once upon",
                 "--layer", "1", "--out", str(vec)])  # fmt: skip
    assert code == 0 and vec.exists()
    out, html = tmp_path / "i.json", tmp_path / "i.html"
    code = main(["intervene", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "4", "--ablate", "0.h1",
                 "--steer", f"1:{vec}:8", "--json", str(out), "--html", str(html), "--no-color"])  # fmt: skip
    assert code == 0
    d = json.loads(out.read_text())
    assert [a["intervention"] for a in d["arms"]] == ["0.h1", f"1:{vec}:8"]
    assert "0.h1" in capsys.readouterr().out
    assert "<html" in html.read_text()


@pytest.mark.parametrize("args, message", [
    (["--ablate", "9.attn"], "ablate: layer must be in 0..1"),
    (["--ablate", "0.h9"], "ablate: head must be in 0..3"),
    ([], "needs at least one --ablate, --steer or --patch"),
])  # fmt: skip
def test_cli_bad_input_exit_2(capsys, tiny_dir, args, message):
    code = main(["intervene", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "2", *args])
    assert code == 2
    assert message in one_error(capsys.readouterr().err)
