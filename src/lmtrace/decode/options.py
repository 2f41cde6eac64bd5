"""What a generation is asked for besides its prompts, as one object: `GenerateOptions`, built
once by the library's keyword arguments, the CLI and the server, and `Plan`, the same options
checked once against the model and the prompts (the sampling params seeded, the draft loaded, the
observers built, what `compile` compiles). generate, stream, generate_ids and generate_each
(decode/tracing.py) are thin wrappers over one plan and one run.

    options = GenerateOptions.of(None, max_new_tokens=8, lens=True)
    traces = tracing.run(lm, options, texts, ids)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from lmtrace import arguments
from lmtrace.decode import attribution as attributing
from lmtrace.decode import static
from lmtrace.decode.observers import Observer, build, checked
from lmtrace.decode.row_state import make_params, seeded
from lmtrace.decode.uncertainty import Uncertainty, observer_for
from lmtrace.errors import InvalidParameter
from lmtrace.inside import probe as inside
from lmtrace.logits import processors
from lmtrace.model import draft as drafts
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams


@dataclass(frozen=True)
class GenerateOptions:
    """Everything a generation takes besides its prompts and `on_step`: the sampling params and
    what is recorded or changed beside them. `echo` records the prompt's own tokens (from the
    prefill pass); `waterfall` (a step index or "all") the distribution after each sampling stage;
    `compile` decodes with the static, compiled step; `lens` every layer's prediction, `attention`
    what each step's token attended to (True: the mean over heads, "heads": each head too);
    `draft` ("packed", "layers:N", a path or an LM) decodes speculatively, `draft_tokens` a block;
    `observers` are the user's lmtrace.Observer instances, `logits_processors` the user's
    `fn(token_ids, logits) -> logits`; `uncertainty` (True or an Uncertainty) the step's and the
    trace's uncertainty; `attribution` the logit difference against `against` split over the
    model's parts."""

    params: SamplingParams = field(default_factory=SamplingParams)
    chat: bool = False
    echo: bool = False
    waterfall: int | str | None = None
    compile: bool = False
    lens: bool = False
    attention: bool | str = False
    draft: str | LM | drafts.Draft | None = None
    draft_tokens: int | str = 4
    observers: Sequence[Observer] = ()
    logits_processors: Sequence[processors.UserFn] = ()
    uncertainty: bool | Uncertainty = False
    attribution: bool = False
    against: str | int | None = None

    @classmethod
    def of(
        cls, params: SamplingParams | None = None, entry: str = "generate", refused: Sequence[str] = (), **kwargs: Any
    ) -> GenerateOptions:
        """The options from keyword arguments: sampling settings laid over `params`, the rest
        options. A keyword that is neither, or one the entry point refuses (`refused`), is
        refused in one line naming it and the entry point."""
        own = {f.name for f in fields(cls)} - {"params"}
        for name in kwargs:
            if name in refused:
                raise InvalidParameter(f"{name}: {entry} does not take {name}")
        chosen = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
        return cls(params=make_params(params, entry, **kwargs), **chosen)


@dataclass
class Plan:
    """The options checked against the model and the prompts: the seeded params, the draft (None:
    plain decoding), the user's processors, the observers run (`watchers`) and those whose
    summaries go on the trace (`own`), the lens/attention probe, what `compile` compiles (the
    trace's `model.config.compile`; None without it)."""

    options: GenerateOptions
    params: SamplingParams
    draft: drafts.Draft | None
    user: list[processors.UserProcessor]
    own: list[Observer]
    probe: inside.Probe
    watchers: list[Observer]
    kind: str | None


def plan(lm: LM, options: GenerateOptions, ids: Sequence[list[int]]) -> Plan:
    """The options checked once, in the order their refusals are most useful (the cheap argument
    checks before the draft is loaded), for these prompts' token ids."""
    o = options
    p = seeded(o.params)
    inside.check(o.compile, o.lens, o.attention)
    chosen = _draft(lm, o)
    probe = inside.Probe(ids, p.top_logprobs, o.lens, o.attention)
    own = checked([*o.observers, *observer_for(o.uncertainty, lm.model.config.vocab_size)])
    own += attributing.wanted(lm, o.attribution, o.against, compile=o.compile)
    user = processors.user_processors(o.logits_processors)
    built = build(probe, echo=o.echo, waterfall=o.waterfall, max_new_tokens=p.max_new_tokens, top_n=p.top_logprobs)
    # the attribution observes before the lens, which runs the final norm again (the norm's hook
    # would keep the lens's input instead of the forward's)
    watchers = own + built
    kind = compiled(lm, o.compile, p, user, watchers, chosen)
    return Plan(o, p, chosen, user, own, probe, watchers, kind)


def _draft(lm: LM, options: GenerateOptions) -> drafts.Draft | None:
    """The draft model asked for (None: plain decoding), its arguments checked."""
    if options.draft is None:
        return None
    arguments.draft_tokens(options.draft_tokens)
    return drafts.draft_for(lm, options.draft)


def compiled(
    lm: LM,
    compile: bool,
    params: SamplingParams,
    user: Sequence[Any],
    watchers: Sequence[Observer],
    draft: drafts.Draft | None = None,
) -> str | None:
    """What `compile` compiles for this generation (the trace's `model.config.compile`; None
    without it); a model torch.compile cannot trace is refused in one line (static.check)."""
    if not compile:
        return None
    if draft is not None:  # only the draft's step compiles: the target's verify forward stays eager
        static.check(draft.model, "draft")
        return static.described(static.DRAFT, lm.model.device)
    static.check(lm.model)
    whole = static.whole_step(params.constraint is not None, user, watchers)
    return static.described(static.STEP if whole else static.FORWARD, lm.model.device)
