"""Turns a validated request body into a Job: the prompt's token ids, SamplingParams (checked
with the CLI's rules), and what the answer must contain. Everything here runs before the
request takes a place in the queue, so a bad request never waits for the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmtrace import arguments
from lmtrace.arguments import MAX_DRAFT_TOKENS
from lmtrace.decode import attribution as attributing
from lmtrace.decode import named_observers
from lmtrace.decode.observers import build
from lmtrace.decode.tracing import encode_prompt
from lmtrace.errors import InvalidParameter
from lmtrace.logits import named, processors
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.registered import Registered
from lmtrace.server import constraints, messages, tools
from lmtrace.server.errors import APIError, bad_request, from_invalid
from lmtrace.server.length import check_fits, check_length, context_size
from lmtrace.server.schemas import ChatRequest, CompletionRequest, Message, Sampling, TraceRequest, unicode_text
from lmtrace.server.tools import ToolPlan

MAX_LOGPROBS = 20  # OpenAI's cap on alternatives per token, for both routes
MAX_N = 16
MAX_PROMPTS = 256  # prompts in one request (times n: rows queued at once)
DEFAULT_MAX_ROWS = 1024  # rows (prompts times n) of one request, lmtrace serve --max-rows-per-request
MAX_STOP = 4
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TRACE_MAX_TOKENS = 64  # the CLI's default


@dataclass
class Prompt:
    ids: list[int]
    text: str


@dataclass
class Job:
    """One request's work: `n` choices for each of its prompts (choice `i * n + j` is prompt
    i's j-th); `many` when the request gave a list of prompts (the answer is a list too)."""

    prompts: list[Prompt]
    params: SamplingParams
    n: int = 1
    chat: bool = False
    logprobs: bool = False  # whether the answer carries logprobs
    sampled: bool = False  # logprobs of the processed distribution instead of the raw one
    echo: bool = False  # the prompt's tokens and their logprobs come first
    generate: bool = True  # False for echo with max_tokens 0: only the prompt is scored
    many: bool = False
    inside: dict = field(default_factory=dict)  # /v1/traces: lens, attention
    draft_tokens: int | None = None  # speculative decoding on a server with a draft (None: its default; 0: none)
    draft: Any = None  # the server's draft (lmtrace.model.draft.Draft) this request decodes with
    tools: ToolPlan | None = None  # chat with tools: the answer's calls are read back (lmtrace.server.tools)
    # echoed prompts share the prefix cache (an evaluation's); a trace's are computed as alone
    share: bool = True
    compile: bool = False  # each choice decoded alone with the compiled step (lmtrace.server.compiled)

    @property
    def top_n(self) -> int:
        return self.params.top_logprobs

    @property
    def ids(self) -> list[int]:  # the first prompt's, for the routes that take one
        return self.prompts[0].ids

    @property
    def prompt_text(self) -> str:
        return self.prompts[0].text

    def prompt_of(self, choice: int) -> Prompt:
        return self.prompts[choice // self.n]

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def check_model(body: Sampling, served: str) -> None:
    if body.model is not None and body.model != served:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )


def _range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise bad_request(f"{name} must be in [{low}, {high}], got {value}", name)


def check_common(body: Sampling) -> None:
    """The fields every generating route checks: n, the penalties, stop, draft_tokens."""
    _range("n", body.n, 1, MAX_N)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise bad_request(f"{name} is not supported by lmtrace serve (only 0), got {getattr(body, name)}", name)
    if body.stop is not None and len(body.stop) > MAX_STOP:
        raise bad_request(f"stop takes at most {MAX_STOP} strings, got {len(body.stop)}", "stop")
    if body.draft_tokens is not None:
        _range("draft_tokens", body.draft_tokens, 0, MAX_DRAFT_TOKENS)


def params_for(
    body: Sampling, max_tokens: int, top_logprobs: int, top_name: str, plan: ToolPlan | None = None,
    vocab: int | None = None,
) -> SamplingParams:  # fmt: skip
    """SamplingParams with the CLI's validation, the constraint compiled (a forced tool call's
    schema under `plan`), a logit bias's token ids within `vocab`; errors name the request's
    fields."""
    fields, renames = constraints.constraint_fields(body)
    if plan is not None and plan.forced:
        if fields.get("json_schema") or any(fields.get(k) for k in constraints.OWN_KEYS):
            other = next(iter(fields))
            other = renames.get(other, other).split(".")[0]
            raise bad_request(f"tool_choice: one constraint at a time, got {other} and tool_choice", "tool_choice")
        fields, renames = {"json_schema": plan.call_schema()}, {"json_schema": "tools"}
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_k=0 if body.top_k == -1 else body.top_k,
            top_p=body.top_p,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            stop=tuple(body.stop or ()),
            top_logprobs=top_logprobs,
            stop_on_eos=not body.ignore_eos,
            logit_bias=body.logit_bias or {},
            **fields,
        )
        if vocab is not None:
            processors.check_logit_bias(params.logit_bias, vocab)
    except InvalidParameter as e:
        raise from_invalid(e, {"top_logprobs": top_name, "stop_on_eos": "ignore_eos", **renames}) from e
    constraints.check(params, renames)
    return params


def vocab_of(lm: LM) -> int:
    """The model's vocabulary size (token ids 0 to it minus 1)."""
    return int(lm.model.config.vocab_size)


def _is_id(t: object) -> bool:
    """A token id: an integer, or a float with no fraction (JSON Schema counts 3.0 an integer)."""
    if isinstance(t, bool):
        return False
    return isinstance(t, int) or (isinstance(t, float) and t.is_integer())


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(_is_id(t) for t in value)


def encode(lm: LM, prompt: object, name: str = "prompt", max_tokens: int = 1) -> tuple[list[int], str]:
    """(token ids, prompt text) of one completion prompt: a string or a list of token ids.
    `name` is how messages call it (`prompt[3]` for an element of a list); a text too long for
    the context with `max_tokens` is refused by its length before it is tokenized."""
    if isinstance(prompt, str):
        if prompt == "":
            raise bad_request(f"{name} must not be empty", "prompt")
        try:
            unicode_text(prompt)
        except ValueError as e:
            raise bad_request(f"{name} {e}", "prompt") from None
        check_length(lm, prompt, max_tokens, name)
        ids = encode_prompt(lm, prompt)
        if not ids:
            raise bad_request(f"{name} must contain at least one token", "prompt")
        return ids, prompt
    if _is_ids(prompt):
        if not prompt:
            raise bad_request(f"{name} must not be empty", "prompt")
        ids = [int(t) for t in prompt]
        vocab = vocab_of(lm)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{name} token ids must be in [0, {vocab - 1}], got {bad[0]}", "prompt")
        return ids, lm.tokenizer.decode(ids)
    raise bad_request(f"{name} must be a string or a list of token ids (integers)", "prompt")


def encode_many(lm: LM, prompt: object, max_tokens: int = 1) -> tuple[list[Prompt], bool]:
    """OpenAI's four shapes: a string, a list of token ids, a list of strings, a list of
    token-id lists. (the prompts, whether a list of prompts was given)."""
    if isinstance(prompt, list) and prompt and not _is_ids(prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"prompt takes at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
        return [Prompt(*encode(lm, p, f"prompt[{i}]", max_tokens)) for i, p in enumerate(prompt)], True
    return [Prompt(*encode(lm, prompt, max_tokens=max_tokens))], False


def encode_chat(
    lm: LM, history: list[Message], plan: ToolPlan | None = None, max_tokens: int = 1,
    template_kw: dict[str, Any] | None = None,
) -> tuple[list[int], str]:  # fmt: skip
    """The conversation through the chat template, as `lmtrace generate --chat` does; with
    tools, as lmtrace.server.tools says; `template_kw` the request's chat_template_kwargs; refused
    by its length before it is tokenized where that proves it too long for the context with
    `max_tokens`."""
    tok = lm.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("messages: this model has no chat template; use /v1/completions", "messages")
    native = plan is not None and plan.native
    turns = messages.turns(history, native=native, reasoning=messages.knows_reasoning(tok.chat_template))
    kw = messages.template_kwargs(template_kw)
    if native:
        kw["tools"] = plan.tools
    elif plan is not None:  # the tools in the system prompt, before its own text
        if turns[0]["role"] in ("system", "developer"):
            turns[0] = {**turns[0], "content": plan.system() + "\n\n" + turns[0]["content"]}
        else:
            turns.insert(0, {"role": "system", "content": plan.system()})
    try:
        text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False, **kw)
    except Exception as e:  # the model's template refused these messages (roles, an order)
        raise bad_request(f"messages: the chat template failed: {' '.join(str(e).split())[:300]}", "messages") from e
    text += plan.prefix() if plan is not None else ""
    check_length(lm, text, max_tokens, "chat prompt", "messages")
    return list(tok(text, add_special_tokens=False)["input_ids"]), text


def completion_job(lm: LM, body: CompletionRequest) -> Job:
    check_common(body)
    if body.best_of not in (None, 1) or body.suffix is not None:
        name = "best_of" if body.best_of not in (None, 1) else "suffix"
        raise bad_request(f"{name} is not supported by lmtrace serve", name)
    if body.logprobs is not None:
        _range("logprobs", body.logprobs, 0, MAX_LOGPROBS)
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    prompts, many = encode_many(lm, body.prompt, max_tokens)
    score_only = body.echo and max_tokens == 0  # as OpenAI and vLLM: echo the prompt, generate nothing
    params = params_for(body, 1 if score_only else max_tokens, body.logprobs or 0, "logprobs", vocab=vocab_of(lm))
    for i, p in enumerate(prompts):
        check_fits(lm, p.ids, max_tokens, f"prompt[{i}]" if many else "prompt")
    mode = body.logprobs_mode == "sampled"
    logprobs = body.logprobs is not None
    job = Job(prompts, params, body.n, False, logprobs, mode, body.echo, not score_only, many)
    job.draft_tokens, job.compile = body.draft_tokens, body.compile
    return job


def chat_job(lm: LM, body: ChatRequest) -> Job:
    check_common(body)
    if body.top_logprobs is not None:
        _range("top_logprobs", body.top_logprobs, 0, MAX_LOGPROBS)
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    plan = tools.plan(body, getattr(lm.tokenizer, "chat_template", None))
    for name in ("max_tokens", "max_completion_tokens"):  # both checked, whichever is used
        value = getattr(body, name)
        if value is not None:
            _range(name, value, 1, context_size(lm) or value)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    ids, text = encode_chat(lm, body.messages, plan, limit or 1, body.chat_template_kwargs)
    if limit is None:  # as OpenAI: up to the end of the context
        limit = max(1, (context_size(lm) or len(ids) + 512) - len(ids))
    top = (body.top_logprobs or 0) if body.logprobs else 0
    params = params_for(body, limit, top, "top_logprobs", plan, vocab_of(lm))
    check_fits(lm, ids, limit, "chat prompt", "messages")
    job = Job([Prompt(ids, text)], params, body.n, True, body.logprobs, body.logprobs_mode == "sampled")
    job.draft_tokens, job.tools, job.compile = body.draft_tokens, plan, body.compile
    return job


def trace_job(lm: LM, body: TraceRequest, known: Registered | None = None) -> Job:
    check_common(body)
    if body.n != 1:
        raise bad_request(f"n must be 1 for /v1/traces, got {body.n}", "n")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", "prompt")
    plan = None
    max_tokens = TRACE_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if body.messages is not None:
        plan = tools.plan(body, getattr(lm.tokenizer, "chat_template", None))
        prompts, many = [Prompt(*encode_chat(lm, body.messages, plan, max_tokens, body.chat_template_kwargs))], False
    else:
        if body.tools is not None or body.tool_choice is not None:
            raise bad_request("tools need messages (a chat), not a prompt", "tools")
        if body.chat_template_kwargs is not None:
            raise bad_request("chat_template_kwargs needs messages (a chat), not a prompt", "chat_template_kwargs")
        prompts, many = encode_many(lm, body.prompt, max_tokens)
    params = params_for(body, max_tokens, body.top_logprobs, "top_logprobs", plan, vocab_of(lm))
    for i, p in enumerate(prompts):
        check_fits(lm, p.ids, max_tokens, f"prompt[{i}]" if many else "prompt")
    sampled = body.logprobs_mode == "sampled"
    job = Job(prompts, params, 1, body.messages is not None, True, sampled, many=many)
    job.inside = {"lens": body.lens, "attention": body.attention}
    if body.uncertainty:  # an observer: the engine's own batch, as lens and attention
        from lmtrace.decode.uncertainty import Uncertainty

        job.inside["observers"] = [Uncertainty(vocab=lm.model.config.vocab_size)]
    job.inside.update(recorded(lm, body, params, known or Registered()))
    job.echo, job.share = body.echo, False  # the prompts measured in their prefill, as alone (lane.py)
    job.draft_tokens, job.tools, job.compile = body.draft_tokens, plan, body.compile
    return job


def recorded(lm: LM, body: Any, params: SamplingParams, known: Registered) -> dict[str, Any]:
    """A trace request's echo, waterfall, attribution, processors and observers (names the server registered),
    checked as generate checks them; errors name the request's field."""
    try:
        arguments.step_selector(body.waterfall, params.max_new_tokens)
        if body.against is not None and not body.attribution:
            raise InvalidParameter(f"against needs attribution, got against={body.against!r} without it")
        if body.attribution:
            attributing.wanted(lm, True, body.against)  # a bad `against` before the request waits
        user = named.resolve(body.logits_processors, known.processors)
        watching = [known.observers[n] for n in named_observers.names(body.observers, known.observers)]
    except InvalidParameter as e:
        raise from_invalid(e) from e
    chosen = {"echo": getattr(body, "echo", False), "waterfall": body.waterfall, "attribution": body.attribution}
    return {**chosen, "against": body.against, "logits_processors": user, "named_observers": watching}


def row_options(lm: LM, job: Job) -> dict[str, Any]:
    """A row's RowSpec options from its request: the lens, the attention, echo, the processors and
    the observers (built for each row: an attribution is a row's own)."""
    x = job.inside
    out = {k: x[k] for k in ("lens", "attention", "echo", "logits_processors") if x.get(k)}
    p = job.params
    observers = list(x.get("observers", ()))
    observers += build(waterfall=x.get("waterfall"), max_new_tokens=p.max_new_tokens, top_n=p.top_logprobs)
    observers += attributing.wanted(lm, bool(x.get("attribution")), x.get("against"))
    observers += [make() for make in x.get("named_observers", ())]  # each row its own
    if observers:
        out["observers"] = observers
    return out
