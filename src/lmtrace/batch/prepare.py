"""From an input line to a job the engine can run: the line's own sampling fields over the
command's defaults, validated; its prompt (or chat messages) as token ids; the context
checked. A line that cannot be done gets its error message instead, and the others go on."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from lmtrace import arguments
from lmtrace.batch.lines import InputLine
from lmtrace.decode import attribution as attributing
from lmtrace.decode import engine, named_observers, static
from lmtrace.decode.tracing import encode_prompt
from lmtrace.errors import InvalidParameter
from lmtrace.inside import probe
from lmtrace.logits import grammar, named
from lmtrace.model.lm import LM, require_chat_template
from lmtrace.params import CONSTRAINTS, SamplingParams

# the per-line fields that override the command's defaults (plus `chat`); a constraint's keys
# (json_schema, regex, choice, grammar, json_whitespace) among them
OVERRIDES = tuple(SamplingParams.__dataclass_fields__)
# generate's options that a batch line cannot have: refused, never silently dropped (a line's
# `logits_processors` and `observers` name those the command registered: --logits-processor
# NAME=module:function, --observer NAME=module:Class)
NOT_IN_A_LINE: tuple[str, ...] = ()


@dataclass
class Extras:
    """A line's `echo`, `waterfall`, `attribution` / `against`, `logits_processors` and
    `observers` (names the command registered)."""

    echo: bool = False
    waterfall: int | str | None = None
    attribution: bool = False
    against: str | int | None = None
    logits_processors: tuple[str, ...] = ()
    observers: tuple[str, ...] = ()


@dataclass
class Job:
    """A line ready to decode; `group` names its settings but the seed (lines of any settings
    share a batch: each row decodes with its own)."""

    line: InputLine
    text: str
    ids: list[int]
    params: SamplingParams
    chat: bool
    messages: list[dict[str, Any]] | None = None
    inside: dict[str, bool | str] = field(default_factory=dict)  # lens / attention (lmtrace.inside.probe)
    draft: dict[str, Any] | None = None  # speculative decoding: {draft, draft_tokens} (lmtrace.model.draft)
    uncertainty: bool = False  # each step's and the trace's `uncertainty` (lmtrace.decode.uncertainty)
    # what a line records or runs beside (generate's options of the same names): the prompt's own
    # logprobs, the waterfall, the attribution, the command's processors it names
    extras: Extras = field(default_factory=lambda: Extras())
    compile: bool = False  # decoded alone with the compiled step, as generate(compile=True) (batch/compiled.py)
    group: str = field(init=False)

    def __post_init__(self) -> None:
        extras = dataclasses.asdict(self.extras)
        settings = {**self.params.to_dict(), "seed": None}
        key = [settings, self.chat, self.inside, self.draft, self.uncertainty, extras, self.compile]
        self.group = json.dumps(key, sort_keys=True)


def defaults_of(params: SamplingParams, chat: bool = False) -> dict[str, Any]:
    """The command's defaults as one plain dict (it travels to Ray workers as it is)."""
    return {**params.to_dict(), "chat": chat}


def line_params(data: dict[str, Any], defaults: dict[str, Any]) -> tuple[SamplingParams, bool]:
    """The line's params over the defaults; raises InvalidParameter naming the field."""
    merged = {k: v for k, v in defaults.items() if k in OVERRIDES}
    if any(k in data for k in CONSTRAINTS):  # a line's own constraint replaces the command's
        merged = {k: v for k, v in merged.items() if k not in CONSTRAINTS}
    merged.update({k: data[k] for k in OVERRIDES if k in data})
    chat = data.get("chat", defaults.get("chat", False))
    if not isinstance(chat, bool):
        raise InvalidParameter(f"chat must be true or false, got {chat!r}")
    if not isinstance(merged.get("stop", ()), str | list | tuple):
        raise InvalidParameter(f"stop must be a string or a list of strings, got {merged['stop']!r}")
    return SamplingParams.from_dict(merged), chat


def _messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    messages = data["messages"]
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise InvalidParameter("messages must be a non-empty list of {role, content} objects with string values")
    return messages


def _encode(lm: LM, data: dict[str, Any], chat: bool) -> tuple[str, list[int], list[dict[str, Any]] | None]:
    if "prompt" in data and "messages" in data:
        raise InvalidParameter("prompt: give prompt or messages, not both")
    if "messages" in data:
        messages = _messages(data)
        tok = lm.tokenizer
        require_chat_template(lm, "messages", "give a prompt instead")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, list(tok(text, add_special_tokens=False)["input_ids"]), messages
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidParameter(f"prompt must be a string (or give messages), got {prompt!r}")
    return prompt, encode_prompt(lm, prompt, chat), None


def prepare(lm: LM, line: InputLine, defaults: dict[str, Any]) -> Job | str:
    """The job of one input line, or the one-line reason it cannot be done."""
    try:
        params, chat = line_params(line.data, defaults)
        for name in NOT_IN_A_LINE:
            if name in line.data:
                raise InvalidParameter(f"{name}: a batch line does not take {name} (lmtrace generate does)")
        grammar.check(params)  # a constraint that does not compile is the line's error
        text, ids, messages = _encode(lm, line.data, chat or "messages" in line.data)
        inside, draft = inside_of(line.data, defaults), draft_of(line.data, defaults)  # checked here: the line's error
        # the engine's own check, so a line's error reads as `lmtrace generate` would say it
        engine.check_context(lm.model, [ids], params)
        extras = extras_of(line.data, defaults, params)
        compiled = compile_of(lm, line.data, inside, extras.attribution)
    except InvalidParameter as e:
        return str(e)
    except (TypeError, ValueError) as e:  # a chat template missing or failing, odd field types
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return Job(
        line,
        text,
        ids,
        params,
        chat or messages is not None,
        messages,
        inside,
        draft,
        uncertainty_of(line.data),
        extras,
        compiled,
    )


def compile_of(lm: LM, data: dict[str, Any], inside: dict[str, bool | str], attribution: bool) -> bool:
    """The line's `compile`, checked as generate checks it: not with the lens, the attention or the
    attribution (hooks inside the compiled forward), nor on a model torch.compile cannot trace."""
    value = data.get("compile", False)
    if not isinstance(value, bool):
        raise InvalidParameter(f"compile must be true or false, got {value!r}")
    if value:
        probe.check(True, inside["lens"], inside["attention"])
        attributing.wanted(lm, attribution, None, compile=True)
        static.check(lm.model)
    return value


def extras_of(data: dict[str, Any], defaults: dict[str, Any], params: SamplingParams) -> Extras:
    """The line's echo, waterfall, attribution, processors and observers (over the command's
    --echo), checked as generate checks them; a processor's or an observer's name must be one the
    command registered."""
    echo = data.get("echo", defaults.get("echo", False))
    if not isinstance(echo, bool):
        raise InvalidParameter(f"echo must be true or false, got {echo!r}")
    waterfall = data.get("waterfall")
    arguments.step_selector(waterfall, params.max_new_tokens)
    attribution, against = data.get("attribution", False), data.get("against")
    if not isinstance(attribution, bool):
        raise InvalidParameter(f"attribution must be true or false, got {attribution!r}")
    if against is not None and not attribution:
        raise InvalidParameter(f"against needs attribution, got against={against!r} without it")
    names = data.get("logits_processors")
    named.resolve(names, named.registry(defaults.get("logits_processors")))
    watching = named_observers.names(data.get("observers"), named_observers.registry(defaults.get("observers")))
    return Extras(echo, waterfall, attribution, against, tuple(names or ()), tuple(watching))


def uncertainty_of(data: dict[str, Any]) -> bool:
    """The line's `uncertainty` (true: the scores of docs/uncertainty.md, at their defaults)."""
    value = data.get("uncertainty", False)
    if not isinstance(value, bool):
        raise InvalidParameter(f"uncertainty must be true or false, got {value!r}")
    return value


def not_for_vllm(job: Job) -> str | None:
    """The first of a line's options that the vLLM engine cannot run (None: it runs them all)."""
    asked = [k for k, v in job.inside.items() if v] + ["draft"] * (job.draft is not None)
    asked += ["uncertainty"] * job.uncertainty
    x = job.extras
    asked += ["waterfall"] * (x.waterfall is not None) + ["attribution"] * x.attribution
    asked += ["logits_processors"] * bool(x.logits_processors) + ["observers"] * bool(x.observers)
    asked += ["compile"] * job.compile
    return asked[0] if asked else None


def inside_of(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, bool | str]:
    """The line's `lens` / `attention` over the command's (--lens, --attention, --attention-heads)."""
    out = {}
    for name in ("lens", "attention"):
        value = data.get(name, defaults.get(name, False))
        if not isinstance(value, bool) and not (name == "attention" and value == "heads"):
            allowed = "true, false or 'heads'" if name == "attention" else "true or false"
            raise InvalidParameter(f"{name} must be {allowed}, got {value!r}")
        out[name] = value
    return out


def draft_of(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any] | None:
    """The line's draft (`draft`: a spec or null, `draft_tokens`) over the command's --draft and
    --draft-tokens; None: plain decoding."""
    draft = data.get("draft", defaults.get("draft"))
    k = data.get("draft_tokens", defaults.get("draft_tokens", 4))
    if draft is None:
        if "draft_tokens" in data:
            raise InvalidParameter(f"draft_tokens: only with a draft (--draft or the line's draft), got {k!r}")
        return None
    return {"draft": arguments.draft_spec(draft), "draft_tokens": arguments.draft_tokens(k)}
