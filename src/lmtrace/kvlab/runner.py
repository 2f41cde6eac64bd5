"""The lab's lockstep loop: the reference replay (full cache) and every arm are fed the same
tokens at the same absolute positions; each pass is followed by the arm's eviction rule, and
each step's distributions are compared before the next token goes in (teacher forcing).

Every arm also chooses its own token from its own logits by the reference's sampling rule and
an equally seeded generator: the first step where that choice leaves the reference's is the
divergence step, and with `free` the arm's cache is forked there to let it generate alone."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmtrace.decode.choosing import Rows, choosing
from lmtrace.kv import ledger
from lmtrace.kvlab import capture, metrics
from lmtrace.kvlab.cache import LabCache
from lmtrace.kvlab.policies.base import Policy
from lmtrace.kvlab.policies.full import Full
from lmtrace.logits import grammar, processors
from lmtrace.params import SamplingParams


@dataclass
class Arm:
    """One policy's run: its cache, its recorder, its steps and its own choices."""

    policy: Policy
    lab: LabCache
    recorder: capture.Recorder | None
    formula: Any
    rng: torch.Generator | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    divergence: int | None = None
    fork: Any = None  # (lab, policy, rng, own token, its Rule) at the divergence step, with `free`
    kept_map: list[list[int]] | None = None
    logits: torch.Tensor | None = None
    seen: list[torch.Tensor] = field(default_factory=list)  # positions each layer attended at this pass


def _dtype_size(model: Any) -> int:
    return next(model.parameters()).element_size()


def new_arm(model: Any, policy: Policy, params: SamplingParams, recorder: capture.Recorder | None = None) -> Arm:
    policy.reset()
    specs = ledger.layer_layout(model.config)
    formulas = [policy.layer_formula(s.kv_heads, s.head_dim, _dtype_size(model)) for s in specs]
    rng = None if params.greedy else torch.Generator(device=model.device).manual_seed(params.seed)
    rec = recorder if recorder is not None else policy.recorder()
    rope = rotary_embedding(model) if policy.rerotates else None
    return Arm(policy, LabCache(policy.make_cache(model), policy.evicting, rope), rec,
               lambda layer, slots, residual=0: formulas[layer](layer, slots, residual), rng)  # fmt: skip


def rotary_embedding(model: Any) -> Any:
    """The model's rotary embedding module, for re-rotating keys; refused where the rotation is
    not the plain one (scaled cos/sin, or no rotary module found)."""
    from lmtrace.kvlab.policies.base import invalid

    rope = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rope is None or getattr(rope, "attention_scaling", 1.0) != 1.0:
        raise invalid("rerotate", "needs a model with a plain rotary embedding (model.model.rotary_emb)")
    if any(spec.kind != ledger.FULL for spec in ledger.layer_layout(model.config)):
        raise invalid("rerotate", "works on models whose layers all use full attention (no sliding window)")
    return rope


def forward(model: Any, arm: Arm, ids: list[int], start: int) -> None:
    """Feeds `ids` at positions start.. (as engine.prefill / decode_step do), then evicts; with
    re-rotation the ids go in at the cache's own length instead and the kept keys are rotated."""
    capture.use(arm.recorder)
    if arm.recorder is not None:
        arm.recorder.clear()
    device = model.device
    fed = arm.lab.next_position(start)
    out = model(
        input_ids=torch.tensor([ids], device=device),  # (1, n)
        attention_mask=None,
        position_ids=torch.arange(fed, fed + len(ids), device=device)[None],  # (1, n)
        logits_to_keep=1,
        **ledger.cache_kwargs(model, arm.lab.cache),
    )
    arm.logits = out.logits[0, -1, :].float()  # (vocab,)
    arm.lab.appended(start, len(ids))
    arm.seen = [p.clone() for p in arm.lab.positions]
    arm.policy.after_forward(arm.lab, arm.recorder, prefill=start == 0)
    if arm.lab.rope is not None:
        arm.lab.rerotate()


@dataclass
class Rule:
    """How the reference chose, which every arm's own choice follows (decode/step.py's Choosing):
    its params, the grammar matcher moved past the reference's tokens (None: unconstrained), the
    user's processors and the reference's tokens so far, which they are handed. An arm's own
    choice moves none of it: only the reference's tokens do (`saw`)."""

    params: SamplingParams
    matcher: grammar.Matcher | None = None
    user: Sequence[processors.UserProcessor] = ()
    history: list[int] = field(default_factory=list)

    def choose(self, arm: Arm, seen: torch.Tensor | None) -> int:
        """The token the arm's own logits give under the reference's rule (and the arm's generator)."""
        grammars = None if self.matcher is None else [self.matcher]
        how = choosing(Rows([self.params], arm.rng, None, [self.history], seen, grammars, self.user))
        processed = how.process(arm.logits[None], how.allowed(arm.logits.shape[-1], [True]))
        return int(how.choose(processed)[0])

    def saw(self, token: int) -> None:
        """The reference's token: the history and the grammar move past it."""
        self.history.append(token)
        if self.matcher is not None:
            grammar.accept([self.matcher], torch.tensor([token]), [True])

    def forked(self, token: int) -> Rule:
        """The rule of an arm that leaves the reference here with its own `token` (free decoding)."""
        rule = Rule(self.params, None if self.matcher is None else self.matcher.fork(), self.user, list(self.history))
        rule.saw(token)
        return rule


def _record(arm: Arm, ref: Arm, ref_lp: torch.Tensor, token: int) -> dict[str, Any]:
    numbers = metrics.step_numbers(ref_lp, arm.logits, token)
    numbers["evicted_mass"] = (
        metrics.evicted_mass(ref.recorder.last, ref.seen, arm.seen) if arm.policy.evicting else 0.0
    )
    numbers["kept"] = [p.numel() for p in arm.lab.positions]
    numbers["bytes"] = arm.lab.measured_bytes()
    numbers["bytes_formula"] = arm.lab.formula_bytes(arm.formula)
    return numbers


def lockstep(
    model: Any,
    prompt_ids: list[int],
    tokens: list[int],
    policies: list[Policy],
    rule: Rule,
    free: bool = False,
    map_step: int | None = None,
    on_step: Any = None,
) -> tuple[Arm, list[Arm]]:
    """Runs the reference replay and the arms over `tokens`; returns (reference, arms). The
    reference's steps hold its own numbers (logprob of each token, its choice); every choice
    follows `rule`."""
    params = rule.params
    ref = new_arm(model, Full(), params, capture.Recorder())
    arms = [new_arm(model, p, params) for p in policies]
    vocab = model.config.get_text_config().vocab_size
    seen_ids = processors.seen_mask(params, [prompt_ids], vocab, model.device)
    with torch.inference_mode(), capture.capturing(model):
        for index, token in enumerate(tokens):
            ids, start = (prompt_ids, 0) if index == 0 else ([tokens[index - 1]], len(prompt_ids) + index - 1)
            for arm in [ref, *arms]:
                forward(model, arm, ids, start)
            ref_lp = torch.log_softmax(ref.logits, dim=-1)
            ref_choice = rule.choose(ref, seen_ids)
            ref.steps.append({"choice": ref_choice, "bytes": ref.lab.measured_bytes()})
            for arm in arms:
                arm.steps.append({"index": index, **_record(arm, ref, ref_lp, token)})
                own = rule.choose(arm, seen_ids)
                if arm.divergence is None and own != ref_choice:
                    arm.divergence = index
                    if free:
                        lab, policy, rng = copy.deepcopy(arm.lab), copy.deepcopy(arm.policy), copy.deepcopy(arm.rng)
                        arm.fork = (lab, policy, rng, own, rule.forked(own))
                if index == map_step:
                    arm.kept_map = arm.lab.kept()
            if seen_ids is not None:
                seen_ids[0, token] = True
            rule.saw(token)
            if on_step is not None:
                on_step(index, ref, ref_lp)
    return ref, arms


def run_free(model: Any, arm: Arm, prompt_ids: list[int], tokens: list[int], eos: list[int]) -> list[int]:
    """Continues a forked arm alone from its divergence step: its own tokens up to as many
    steps as the reference has, or its end token, chosen by the reference's rule forked there."""
    if arm.fork is None:
        return []
    lab, policy, rng, own, rule = arm.fork
    params = rule.params
    alone = Arm(policy, lab, arm.recorder, arm.formula, rng)
    out = [own]
    # the penalty's view: prompt, the shared tokens, its own
    seen = processors.seen_mask(params, [prompt_ids + tokens[: arm.divergence] + [own]],
                                model.config.get_text_config().vocab_size, model.device)  # fmt: skip
    with torch.inference_mode(), capture.capturing(model):
        for index in range(arm.divergence + 1, len(tokens)):
            if out[-1] in eos:
                break
            forward(model, alone, [out[-1]], len(prompt_ids) + index - 1)
            out.append(rule.choose(alone, seen))
            if seen is not None:
                seen[0, out[-1]] = True
            rule.saw(out[-1])
    return out
