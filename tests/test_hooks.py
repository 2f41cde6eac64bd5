"""inside/hooks.py: the named hook points read the residual stream where the model itself computes
it (a Llama block: resid_post = resid_pre + attn_out + mlp_out; the head over norm.out gives the
model's logits), every hook leaves with its `with`, and it is the only module that hooks a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmtrace.errors import InvalidParameter
from lmtrace.inside.hooks import BLOCK_POINTS, MODEL_POINTS, Hooks, hooked

SRC = Path(__file__).resolve().parent.parent / "src" / "lmtrace"


def hooks_on(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def run(lm, points: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each point's tensor over one forward of a short prompt, and the model's logits."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def output_hook(module, args, output):
            seen[name] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        def input_hook(module, args, kwargs):
            seen[name] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return input_hook if name.endswith((".in", "resid_pre", "attn.z")) else output_hook

    ids = torch.tensor([lm.tokenizer("the cat sat on the mat")["input_ids"]])
    with torch.inference_mode(), Hooks(lm.model) as hooks:
        for name in points:
            hooks.add(name, keep(name))
        logits = lm.model(input_ids=ids, use_cache=False).logits
    return seen, logits


def test_a_block_writes_its_attention_and_mlp_into_the_residual(tiny_lm):
    layers, before = tiny_lm.model.config.num_hidden_layers, hooks_on(tiny_lm.model)
    names = ["embed", "norm.in", "norm.out", "unembed"]
    names += [f"blocks.{i}.{p}" for i in range(layers) for p in ("resid_pre", "resid_post", "attn_out", "mlp_out")]
    seen, logits = run(tiny_lm, names)
    assert torch.equal(seen["embed"], seen["blocks.0.resid_pre"])
    for i in range(layers):
        pre, post = seen[f"blocks.{i}.resid_pre"], seen[f"blocks.{i}.resid_post"]
        torch.testing.assert_close(pre + seen[f"blocks.{i}.attn_out"] + seen[f"blocks.{i}.mlp_out"], post)
        following = f"blocks.{i + 1}.resid_pre" if i + 1 < layers else "norm.in"
        assert torch.equal(post, seen[following])
    assert torch.equal(seen["unembed"], logits)
    with torch.inference_mode():
        assert torch.equal(tiny_lm.model.lm_head(seen["norm.out"]), logits)
    assert hooks_on(tiny_lm.model) == before  # transformers' own output-capturing hooks aside


def test_a_hook_that_returns_a_value_changes_the_forward_and_leaves_with_its_with(tiny_lm):
    ids, hooks = torch.tensor([tiny_lm.tokenizer("the cat")["input_ids"]]), hooks_on(tiny_lm.model)
    with torch.inference_mode():
        before = tiny_lm.model(input_ids=ids, use_cache=False).logits
        with hooked(tiny_lm.model, "blocks.0.mlp_out", lambda m, a, out: torch.zeros_like(out)):
            assert hooks_on(tiny_lm.model) == hooks + 1
            changed = tiny_lm.model(input_ids=ids, use_cache=False).logits
        after = tiny_lm.model(input_ids=ids, use_cache=False).logits
    assert not torch.equal(before, changed) and torch.equal(before, after)
    assert hooks_on(tiny_lm.model) == hooks


@pytest.mark.parametrize("name", ["blocks.9.resid_post", "blocks.x.resid_post", "blocks.0.nowhere", "lm_head", ""])
def test_a_point_the_model_lacks_is_refused_by_name(tiny_lm, name):
    with pytest.raises(InvalidParameter, match="hook point"):
        Hooks(tiny_lm.model).add(name, lambda *a: None)
    with pytest.raises(InvalidParameter, match="sandwich|no such module"):
        Hooks(tiny_lm.model).add("blocks.0.attn.o", lambda *a: None)  # a Llama layer has no sandwich norm


def test_every_point_is_documented_and_only_this_module_registers_hooks():
    doc = (SRC / "inside" / "hooks.py").read_text(encoding="utf-8").split('"""')[1]
    assert all(name in doc for name in (*MODEL_POINTS, *BLOCK_POINTS))
    hooking = sorted(
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if "register_forward_hook" in path.read_text(encoding="utf-8")
        or "register_forward_pre_hook" in path.read_text(encoding="utf-8")
    )
    assert hooking == ["inside/hooks.py"]
