"""Attribution per generated token: the parts sum to the raw logit difference, each layer's
attention and MLP part equals a hand computation from a full teacher-forced forward with
forward hooks (the oracle: transformers' own modules, no cache), and the heads of a layer sum
to its attention part. Every architecture the lens supports, and the bundled model."""

from __future__ import annotations

import json

import pytest
import torch

import lmtrace
from lmtrace.cli import main
from lmtrace.errors import InvalidParameter
from lmtrace.records import Trace
from tests.cli_errors import one_error
from tests.tiny_archs import ARCHS, tiny_arch

PROMPTS = ["Hello world, the", "Once upon a time there"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_lm(request, tiny_tok):
    return request.param, tiny_arch(request.param, tiny_tok)


def _writers(arch: str, layer):
    """(attention writer, MLP writer, o_proj) of a decoder layer, named by hand per architecture."""
    if arch == "gpt2":
        return layer.attn, layer.mlp, layer.attn.c_proj
    if arch == "gemma2":
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm, layer.self_attn.o_proj
    return layer.self_attn, layer.mlp, layer.self_attn.o_proj


def hand_parts(arch: str, model, ids: list[int], a: int, b: int) -> dict[str, float]:
    """Every part at the last position of one full forward over `ids`, by hand."""
    decoder = model.transformer if arch == "gpt2" else model.model
    layers = decoder.h if arch == "gpt2" else decoder.layers
    norm = decoder.ln_f if arch == "gpt2" else decoder.norm
    got: dict[str, torch.Tensor] = {}

    def keep(name: str, out) -> None:
        got[name] = (out[0] if isinstance(out, tuple) else out)[0, -1]

    hooks = [layers[0].register_forward_pre_hook(
        lambda m, args, kw: got.__setitem__("embed", (args[0] if args else kw["hidden_states"])[0, -1]),
        with_kwargs=True)]  # fmt: skip
    hooks.append(norm.register_forward_pre_hook(lambda m, args: got.__setitem__("h", args[0][0, -1])))
    for i, layer in enumerate(layers):
        attn, mlp, _ = _writers(arch, layer)
        hooks.append(attn.register_forward_hook(lambda m, args, out, i=i: keep(f"L{i}.attn", out)))
        hooks.append(mlp.register_forward_hook(lambda m, args, out, i=i: keep(f"L{i}.mlp", out)))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    W = model.get_output_embeddings().weight.detach()
    d = (W[a] - W[b]).double()
    h = got["h"].double()
    if arch == "gpt2":  # LayerNorm: w * (c - mean c) / std, its bias a part of its own
        scale = norm.weight.detach().double() / torch.sqrt(h.var(unbiased=False) + norm.eps)
        out = {k: float(d @ (scale * (v.double() - v.double().mean()))) for k, v in got.items() if k != "h"}
        out["ln_f.bias"] = float(d @ norm.bias.detach().double())
        return out
    w = norm.weight.detach().double()
    gain = (1 + w) if arch == "gemma2" else w
    eps = norm.eps if arch == "gemma2" else norm.variance_epsilon
    scale = gain / torch.sqrt(h.pow(2).mean() + eps)
    return {k: float(d @ (scale * v.double())) for k, v in got.items() if k != "h"}


def _by_layer(heads: list[dict]) -> dict[int, float]:
    out: dict[int, float] = {}
    for h in heads:
        out[h["layer"]] = out.get(h["layer"], 0.0) + h["value"]
    return out


def check_trace(arch: str, model, trace: Trace, hand_tol: float = 1e-5) -> int:
    checked = 0
    ids = list(trace.prompt["token_ids"])
    for step in trace.steps:
        a = step.attribution
        assert a["token_id"] == step.token_id
        assert abs(sum(p["value"] for p in a["parts"]) - a["logit_diff"]) < 1e-4
        parts = {p["component"]: p["value"] for p in a["parts"]}
        hand = hand_parts(arch, model, ids, a["token_id"], a["against_token_id"])
        for name, value in hand.items():
            assert parts[name] == pytest.approx(value, abs=hand_tol), (step.index, name)
        for layer, total in _by_layer(a["heads"]).items():
            assert total == pytest.approx(parts[f"L{layer}.attn"], abs=1e-5), (step.index, layer)
        ids.append(step.token_id)
        checked += 1
    return checked


def test_parts_sum_match_hooks_and_heads_sum_every_arch(arch_lm):
    arch, lm = arch_lm
    traces = lmtrace.generate(lm, PROMPTS, max_new_tokens=6, temperature=0, attribution=True, stop_on_eos=False)
    for trace in traces:
        assert check_trace(arch, lm.model, trace) == 6
    names = [p["component"] for p in traces[0].steps[0].attribution["parts"]]
    layers = lm.model.config.num_hidden_layers
    assert names[: 1 + 2 * layers] == ["embed"] + [f"L{i}.{k}" for i in range(layers) for k in ("attn", "mlp")]
    extra = {"gpt2": ["ln_f.bias"], "gemma2": ["softcap"]}.get(arch, [])
    assert names[1 + 2 * layers :] == extra
    heads = traces[0].steps[0].attribution["heads"]
    per = 4 + (1 if arch == "gpt2" else 0)  # GPT-2's c_proj has a bias: its own entry, head "bias"
    assert len(heads) == layers * per


def test_attribution_changes_nothing_it_observes(tiny_lm):
    kw = {"max_new_tokens": 6, "temperature": 1.0, "seed": 11, "top_logprobs": 5}
    plain = lmtrace.generate(tiny_lm, PROMPTS, **kw)
    traced = lmtrace.generate(tiny_lm, PROMPTS, attribution=True, **kw)
    for a, b in zip(plain, traced):
        assert a.token_ids == b.token_ids
        assert [s.logprob for s in a.steps] == [s.logprob for s in b.steps]


def test_an_ablated_head_attributes_nothing(tiny_lm):
    from lmtrace.inside import intervene as hooks

    with hooks.applied(tiny_lm.model, [hooks.parse_ablate("1.h2", tiny_lm.model)]):
        trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, attribution=True)
    for step in trace.steps:
        heads = {(h["layer"], h["head"]): h["value"] for h in step.attribution["heads"]}
        assert heads[(1, 2)] == 0.0 and heads[(1, 1)] != 0.0
        assert abs(sum(p["value"] for p in step.attribution["parts"]) - step.attribution["logit_diff"]) < 1e-4


def test_sampled_and_runner_up(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=8, temperature=1.0, seed=3, attribution=True)
    for step in trace.steps:
        a = step.attribution
        assert a["against_token_id"] != step.token_id
        assert abs(sum(p["value"] for p in a["parts"]) - a["logit_diff"]) < 1e-4
    greedy = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, attribution=True)
    for step in greedy.steps:  # the runner-up of a greedy choice: the chosen token wins by logit_diff >= 0
        assert step.attribution["logit_diff"] >= 0
        assert step.attribution["against_token_id"] == step.top[1].token_id
    same = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, attribution=True, against="rank:1")
    assert [s.attribution for s in same.steps] == [s.attribution for s in greedy.steps]


def test_against_a_token_and_json_round_trip(tiny_lm):
    tok = tiny_lm.tokenizer
    word = next(t for t, i in sorted(tok.get_vocab().items(), key=lambda x: x[1]) if t.isalpha() and len(t) > 2)
    target = tok.get_vocab()[word]
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=3, temperature=0, attribution=True, against=word)
    assert {s.attribution["against_token_id"] for s in trace.steps} == {target}
    by_id = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=3, temperature=0, attribution=True, against=target)
    assert [s.attribution for s in by_id.steps] == [s.attribution for s in trace.steps]
    back = Trace.from_json(trace.to_json())
    assert back.steps[1].attribution == trace.steps[1].attribution
    assert "attribution" in json.loads(trace.to_json())["steps"][0]


@pytest.mark.parametrize("kw, message", [
    ({"attribution": True, "against": "rank:0"}, "rank:N needs a whole number N >= 1"),
    ({"attribution": True, "against": "rank:100000"}, "against: rank must be in 1.."),
    ({"attribution": True, "against": 10**6}, "against: token id must be in 0.."),
    ({"attribution": True, "against": "Hello world, the quick"}, "is not one token of the tokenizer"),
    ({"against": "rank:3"}, "against needs attribution"),
    ({"attribution": True, "compile": True}, "compile cannot be combined with attribution"),
])  # fmt: skip
def test_bad_input_is_one_named_error(tiny_lm, kw, message):
    with pytest.raises(InvalidParameter, match=message):
        lmtrace.generate(tiny_lm, "Hello", max_new_tokens=2, **kw)


def test_cli_attribution(capsys, tiny_dir, tmp_path):
    out = tmp_path / "t.json"
    code = main(["generate", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "3", "--temperature", "0",
                 "--attribution", "--against", "rank:3", "--json", str(out), "--no-color"])  # fmt: skip
    assert code == 0
    steps = json.loads(out.read_text())["steps"]
    assert all(abs(sum(p["value"] for p in s["attribution"]["parts"]) - s["attribution"]["logit_diff"]) < 1e-4
               for s in steps)  # fmt: skip
    assert "largest parts" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--attribution", "--against", "rank:x"], "against: rank:N needs a whole number"),
    (["--attribution", "--against", "Hello world, the quick"], "is not one token"),
    (["--against", "rank:3"], "against needs --attribution"),
])  # fmt: skip
def test_cli_bad_against_exit_2(capsys, tiny_dir, args, message):
    code = main(["generate", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "2", *args])
    assert code == 2
    assert message in one_error(capsys.readouterr().err)


@pytest.mark.integration
def test_bundled_model_every_step(bundled_lm):
    trace = lmtrace.generate(bundled_lm, "The capital of France is", max_new_tokens=6, temperature=0,
                             attribution=True)  # fmt: skip
    assert check_trace("llama", bundled_lm.model, trace) == 6
