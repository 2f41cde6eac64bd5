"""Step, Alternative and Trace: what a traced generation records, with a lossless JSON round
trip (-inf is written as null) and the OpenAI chat `logprobs.content` export. TokenScore and
Candidate: a teacher-forced token (scoring, and a prompt's own tokens)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from lmtrace.columnar import is_columnar
from lmtrace.errors import InvalidParameter

SCHEMA_VERSION = 1

# Jupyter's HTML view of a Trace, registered from above (the package's __init__) so that the
# records import no renderer
_notebook_view: Callable[[Any], str] | None = None


def set_notebook_view(view: Callable[[Any], str] | None) -> None:
    """Registers the function that renders a record for Jupyter (`_repr_html_`)."""
    global _notebook_view
    _notebook_view = view


def _num(x: float | None) -> float | None:
    """JSON has no infinities: a filtered token's -inf is written as null."""
    return None if x is None or math.isinf(x) else x


def _inf(x: float | None) -> float:
    return float("-inf") if x is None else float(x)


class WithEntries:
    """Reads an observer's entry by its name (`step.uncertainty`, `trace.uncertainty`)."""

    def __getattr__(self, name: str) -> Any:
        entries = self.__dict__.get("entries")
        if entries is not None and name in entries:
            return entries[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or observer entry {name!r}")


@dataclass
class Alternative:
    """One of the most likely tokens at a step, under the raw distribution (under the processed
    one in a trace that holds only that). None: the distribution was not recorded."""

    token_id: int
    text: str
    bytes: list[int]
    logprob: float | None
    sampled_logprob: float | None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["logprob"], d["sampled_logprob"] = _num(self.logprob), _num(self.sampled_logprob)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Alternative:
        return cls(d["token_id"], d["text"], list(d["bytes"]), _inf(d["logprob"]), _inf(d["sampled_logprob"]))


@dataclass
class Step(WithEntries):
    """One generated token. `logprob`/`rank`/`entropy` are under the raw distribution;
    `sampled_*` under the processed one the token was chosen from. None where the trace does not
    hold that distribution (`Trace.distributions`), and `time_ms` None where it was not timed."""

    index: int
    token_id: int
    text: str
    bytes: list[int]
    logprob: float | None
    sampled_logprob: float | None
    rank: int | None
    entropy: float | None
    sampled_entropy: float | None
    top: list[Alternative]
    kv: dict[str, Any]
    time_ms: float | None
    # the distribution after each sampling stage, one dict per stage (lmtrace.logits.waterfall); only
    # where asked for
    waterfall: list[dict[str, Any]] | None = None
    # the logit lens {settled_at, layers: [...]} and the attention over the cache {layers: [...]}
    # (lmtrace.inside.lens, lmtrace.inside.attention); only where asked for
    lens: dict[str, Any] | None = None
    attention: dict[str, Any] | None = None
    # a watched loop's cache misuse, on the step (round) where it starts (lmtrace.watch)
    problems: list[dict[str, Any]] | None = None
    # a constrained step (lmtrace.logits.grammar): {allowed: tokens the grammar allowed,
    # removed_mass: the raw probability of the others, logprob: the chosen token's log-probability
    # under the raw distribution restricted to the allowed tokens}
    grammar: dict[str, Any] | None = None
    # speculative decoding: the draft's proposal judged at this step {proposed_token_id, text,
    # logprob (the draft's processed q), target_logprob (p), accept_prob, accepted, position,
    # block}; None for a bonus token (written as null in a speculative trace)
    draft: dict[str, Any] | None = None
    # what the observers a generation ran wrote at this step, one entry per observer name
    # (lmtrace.decode.observers.Observer: `uncertainty`, `attribution`, a user's own): written in
    # the step's JSON under that name, read as `step.NAME`
    entries: dict[str, Any] = field(default_factory=dict)

    @property
    def prob(self) -> float | None:
        return None if self.logprob is None else math.exp(self.logprob)

    def __repr__(self) -> str:
        p = "–" if self.logprob is None else f"{math.exp(self.logprob):.4g}"
        return f"Step({self.index}, {self.text!r}, id={self.token_id}, p={p}, rank={self.rank}, top={len(self.top)})"

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("top", "entries")}
        d["logprob"], d["sampled_logprob"] = _num(self.logprob), _num(self.sampled_logprob)
        d["top"] = [a.to_dict() for a in self.top]
        if self.draft is not None:  # a proposal the target's filters removed has p = -inf: null
            d["draft"] = {k: _num(v) if k in _DRAFT_LOGPROBS else v for k, v in self.draft.items()}
        for name in ("waterfall", "problems", "lens", "attention", "grammar", "draft"):  # written only when present
            if d[name] is None:
                del d[name]
        d.update(self.entries)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Step:
        skip = ("top", "logprob", "sampled_logprob", "entries", *_OPTIONAL)
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k not in skip}
        return cls(
            **fields,
            logprob=_inf(d["logprob"]),
            sampled_logprob=_inf(d["sampled_logprob"]),
            top=[Alternative.from_dict(a) for a in d["top"]],
            waterfall=d.get("waterfall"),
            lens=d.get("lens"),
            attention=d.get("attention"),
            problems=d.get("problems"),
            grammar=d.get("grammar"),
            draft=_draft_from(d.get("draft")),
            entries={k: v for k, v in d.items() if k not in cls.__dataclass_fields__},
        )


# a step's `draft` numbers that are log-probabilities (-inf where filtered, null in JSON)
_DRAFT_LOGPROBS = ("logprob", "target_logprob")


def _draft_from(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: _inf(v) if k in _DRAFT_LOGPROBS else v for k, v in d.items()}


# fields added after schema 1 was first written: absent from older JSON, omitted when unset
_OPTIONAL = (
    "waterfall",
    "prompt_logprobs",
    "problems",
    "lens",
    "attention",
    "grammar",
    "fields",
    "choices",
    "draft",
    "speculative",
)


# the keys to_dict() writes after the steps (as it always has): the steps come before them
_AFTER_STEPS = ("prompt_logprobs", "fields", "choices", "speculative")


# keys that records written around a trace add to its dict (a branch's column label): not entries
_NOT_ENTRIES = ("label",)


def _forget(steps: list[Step], distributions: str) -> None:
    """JSON writes a filtered token's -inf and an unrecorded number both as null: a trace that
    holds one distribution only reads the other's numbers back as None (unknown)."""
    raw = ("logprob", "rank", "entropy")
    processed = ("sampled_logprob", "sampled_entropy")
    gone = raw if distributions == "processed" else processed if distributions == "raw" else ()
    for s in steps:
        for name in gone:
            setattr(s, name, None)
        for a in s.top:
            if "logprob" in gone:
                a.logprob = None
            if "sampled_logprob" in gone:
                a.sampled_logprob = None


@dataclass
class Candidate:
    """One of the most likely tokens at a teacher-forced position (raw distribution)."""

    token_id: int
    text: str
    bytes: list[int]
    logprob: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(d["token_id"], d["text"], list(d["bytes"]), float(d["logprob"]))


@dataclass
class TokenScore:
    """A token of a given text, teacher-forced: its logprob, rank and entropy under the raw
    distribution at its position. The first token of a sequence has no context: all null."""

    token_id: int
    text: str
    bytes: list[int]
    logprob: float | None
    rank: int | None
    entropy: float | None
    top: list[Candidate]

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "top"}
        d["top"] = [c.to_dict() for c in self.top]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenScore:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k != "top"}
        return cls(**fields, top=[Candidate.from_dict(c) for c in d["top"]])


@dataclass
class Trace(WithEntries):
    """A whole traced generation: header (model, params, prompt, timing) and steps."""

    model: dict[str, Any]
    params: dict[str, Any]
    prompt: dict[str, Any]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    timing: dict[str, Any]
    versions: dict[str, str]
    steps: list[Step] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    # the KV cache's dimensions explained (kvsize.Anatomy.to_dict) and the steps, if any, where
    # the measured bytes differ from the formula
    kv_anatomy: dict[str, Any] | None = None
    # the prompt's own tokens, teacher-forced in the prefill pass (generate with echo=True)
    prompt_logprobs: list[TokenScore] | None = None
    # where the trace came from: "lmtrace" (its own loop), "model.generate" (from_generate),
    # "watch" (a person's own loop, watched) or "vllm" (batch --engine vllm); older traces are lmtrace's
    origin: str = "lmtrace"
    # which distributions the steps hold: "both", "raw" (logprob, rank, entropy) or "processed"
    # (sampled_logprob, sampled_entropy); the numbers of a missing one are None, never guessed
    distributions: str = "both"
    # a JSON-schema output's values: [{path, text, chars, start_step, end_step, logprob,
    # raw_logprob, min_prob}] (lmtrace.decode.fields); a choice's options: [{text, logprob, tokenizations}],
    # each option's exact probability under the constraint (lmtrace.decode.choices)
    fields: list[dict[str, Any]] | None = None
    choices: list[dict[str, Any]] | None = None
    # speculative decoding (lmtrace.generate(..., draft=...)): {draft, draft_tokens,
    # acceptance_by_position, conditional_acceptance_by_position, mean_accepted_per_block, blocks,
    # target_forwards, draft_forwards, draft_model}; then every step has `draft` (null: a bonus token)
    speculative: dict[str, Any] | None = None
    # the observers' trace-level entries (Observer.summarize), by name: `uncertainty`, ...
    entries: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        head = self.head_dict()
        d = {k: v for k, v in head.items() if k not in _AFTER_STEPS}
        d["steps"] = list(self.step_dicts())
        d.update((k, v) for k, v in head.items() if k in _AFTER_STEPS)
        return d

    def head_dict(self) -> dict[str, Any]:
        """`to_dict()` without the steps: what a file writes around them (lmtrace.trace_file)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("steps", "entries", *_OPTIONAL)}
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = [t.to_dict() for t in self.prompt_logprobs]
        if self.fields is not None:
            d["fields"] = self.fields
        if self.choices is not None:
            d["choices"] = [{**c, "logprob": _num(c["logprob"])} for c in self.choices]
        if self.speculative is not None:
            d["speculative"] = self.speculative
        d.update(self.entries)
        return d

    def step_dicts(self) -> Iterator[dict[str, Any]]:
        """Each step's dict as `to_dict()` holds it, one at a time (a file is written step by step)."""
        bonus = self.speculative is not None and self.speculative.get("proposals_recorded", True)
        for s in self.steps:
            out = s.to_dict()
            if bonus:  # from_generate's assisted runs hold no proposals
                out.setdefault("draft", None)  # null: a bonus token
            yield out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        version = d.get("schema_version")
        if is_columnar(d):  # a file's lens and attention in their columnar form
            from lmtrace.trace_file import expanded

            d = expanded(d)
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {version!r}")
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k not in ("steps", "entries", *_OPTIONAL) and k in d}
        entries = {k: v for k, v in d.items() if k not in cls.__dataclass_fields__ and k not in _NOT_ENTRIES}
        prompt_logprobs = d.get("prompt_logprobs")
        if prompt_logprobs is not None:
            prompt_logprobs = [TokenScore.from_dict(t) for t in prompt_logprobs]
        steps = [Step.from_dict(s) for s in d["steps"]]
        _forget(steps, d.get("distributions", "both"))
        choices = d.get("choices")
        if choices is not None:
            choices = [{**c, "logprob": _inf(c["logprob"])} for c in choices]
        return cls(
            **fields,
            steps=steps,
            prompt_logprobs=prompt_logprobs,
            fields=d.get("fields"),
            choices=choices,
            speculative=d.get("speculative"),
            entries=entries,
        )

    @classmethod
    def from_json(cls, s: str) -> Trace:
        """A trace from its JSON (`to_json()`, a `--json` file) or its JSON Lines (`--jsonl`)."""
        from lmtrace.trace_file import loads

        return cls.from_dict(loads(s))

    def to_openai(self, sampled: bool = False) -> dict[str, Any]:
        """OpenAI chat `choices[].logprobs` shape: {"content": [{token, logprob, bytes,
        top_logprobs}]}. Raw logprobs by default; `sampled=True` gives the processed ones."""
        key = "sampled_logprob" if sampled else "logprob"
        if self.distributions == ("raw" if sampled else "processed"):
            raise InvalidParameter(
                f"to_openai: this trace holds only the {self.distributions} distribution; "
                f"call to_openai(sampled={not sampled})"
            )

        def entry(token: str, raw_bytes: list[int], lp: float) -> dict[str, Any]:
            return {"token": token, "logprob": max(lp, -9999.0), "bytes": raw_bytes}

        content = []
        for s in self.steps:
            own = bytes(s.bytes).decode("utf-8", errors="replace")
            item = entry(own, s.bytes, getattr(s, key))
            item["top_logprobs"] = [entry(a.text, a.bytes, getattr(a, key)) for a in s.top]
            content.append(item)
        return {"content": content}

    def _repr_html_(self) -> str | None:
        """Jupyter's view: the coloured tokens, each with a hover panel of its alternatives
        (the renderer registered by the package, lmtrace/__init__.py; None: plain repr)."""
        return _notebook_view(self) if _notebook_view is not None else None

    def __repr__(self) -> str:
        """One line: the model, the steps, how the generation ended, the start of its text."""
        text = self.text if len(self.text) <= 48 else self.text[:47] + "…"
        source = self.model.get("source") if isinstance(self.model, dict) else self.model
        return f"Trace({source!r}, {len(self.steps)} steps, finish_reason={self.finish_reason!r}, text={text!r})"

    def __str__(self) -> str:
        """A short table: the one line, the prompt, then a row per step (the first 20)."""
        rows = [repr(self), f"prompt: {self.prompt.get('text', '')!r}", "   #  token              prob  rank  entropy"]
        for s in self.steps[:20]:
            p = "–" if s.logprob is None else f"{math.exp(s.logprob):.3f}"
            h = "–" if s.entropy is None else f"{s.entropy:.2f}"
            rows.append(f"{s.index:>4}  {s.text!r:<16.16} {p:>6}  {s.rank if s.rank is not None else '–':>4}  {h:>7}")
        if len(self.steps) > 20:
            rows.append(f"   … {len(self.steps) - 20} more steps")
        return "\n".join(rows)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))
