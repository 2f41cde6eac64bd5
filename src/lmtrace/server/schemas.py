"""Request bodies, as OpenAI names them. Pydantic checks types only (strictly: no "0.5"
strings for numbers); value ranges are checked by SamplingParams and prepare.py, with the
same rules and messages as the CLI. Unknown fields are refused, as OpenAI refuses them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator


def unicode_text(value: str) -> str:
    """JSON can carry a lone surrogate ("\\ud800"), which is no text: no tokenizer takes it
    and no answer could echo it as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]


def whole_number(value: Any) -> Any:
    """JSON Schema counts 2.0 an integer: a float with no fraction is taken as one; 2.5 is
    refused in one line (a bool or a string is left for the strict check to refuse)."""
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError("must be an integer")
    return value


# an integer field: 3 or 3.0
Int = Annotated[int, BeforeValidator(whole_number)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # Send a last chunk with `usage` (and no choices) before [DONE].
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema the output follows (`strict` accepted:
    the grammar enforces the schema as given either way)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Text
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: Text | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (unconstrained), "json_object" (any JSON object) or
    "json_schema"."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of json (a schema, or its text), regex, choice, grammar
    (EBNF), json_object. `disable_any_whitespace`: lmtrace compiles JSON compact unless it is
    false (vLLM's lenient grammar)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class Sampling(BaseModel):
    """Fields every generating route shares."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # The served model's id (GET /v1/models); optional, any other value is a 404.
    model: Text | None = None
    # Tokens to generate at most; the prompt plus this must fit the model's context.
    max_tokens: Int | None = None
    # 0 means greedy; otherwise logits are divided by it before sampling.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability adds up to top_p.
    top_p: float = 1.0
    # Extension: keep only the k most likely tokens; 0 (or -1, vLLM's spelling) disables.
    top_k: Int = 0
    # Extension: drop tokens whose probability is below min_p times the top token's.
    min_p: float = 0.0
    # Extension: divide positive logits (multiply negative ones) of tokens already seen.
    repetition_penalty: float = 1.0
    # OpenAI's: {token id (a string): bias in [-100, 100]}, added to those logits before every
    # other processor (greedy decoding too); raw logprobs stay the model's own, "sampled" ones
    # are after it (logprobs_mode).
    logit_bias: dict[str, float] | None = None
    # Seed of the sampler; the same seed and request give the same output.
    seed: Int | None = None
    # Up to 4 strings that end the generation; the text is cut before the first one.
    stop: Text | list[Text] | None = None
    # Choices to generate for the prompt (decoded together as one batch).
    n: Int = 1
    # Answer with server-sent events, ending with `data: [DONE]`.
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extension: "raw" logprobs are the model's own distribution (temperature 1, nothing
    # filtered); "sampled" ones are of the processed distribution the token was drawn from.
    logprobs_mode: Literal["raw", "sampled"] = "raw"
    # Extension (as vLLM): keep generating past the end-of-sequence token.
    ignore_eos: bool = False
    # Extension: tokens the draft proposes per block (1-16), on a server started with --draft
    # (speculative decoding; the numbers stay the model's). Default: the server's --draft-tokens.
    draft_tokens: Int | None = None
    # Accepted for compatibility and ignored.
    user: Text | None = None
    # Accepted only at their neutral value 0: lmtrace does not implement them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Constrained decoding (lmtrace.server.constraints): OpenAI's response_format or vLLM's
    # structured_outputs; at most one constraint per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class Observing(BaseModel):
    """What each step records beside its logprobs, the same fields on /v1/traces (the step's
    own entries) and on completions and chat (lmtrace.server.observed: an extension object
    beside each token's logprobs)."""

    # Record every layer's prediction per step (the logit lens) / the attention over the cache
    # (true: the mean over heads; "heads": also each head's own).
    lens: bool = False
    attention: bool | Literal["heads"] = False
    # Record each step's confidence, margin, varentropy and the trace's sequence scores (the
    # CLI's --uncertainty, DeepConf's k 20 and window/tail 2048; docs/uncertainty.md).
    uncertainty: bool = False
    # The distribution after each sampling stage at a step index, or at "all" steps (--waterfall).
    waterfall: Int | Literal["all"] | None = None
    # Each step's logit difference against `against` split over the layers and heads (--attribution,
    # --against: "rank:N", a token id or a token's text).
    attribution: bool = False
    against: Int | Text | None = None
    # Processors the server registered by name (lmtrace serve --logits-processor NAME=module:function),
    # run first, in this order.
    logits_processors: list[Text] | None = None
    # Observers the server registered by name (lmtrace serve --observer NAME=module:Class): each
    # step's entry under the observer's own name.
    observers: list[Text] | None = None


class Compiling(BaseModel):
    """The compiled decode step, on a server that lets requests ask for it (lmtrace serve --compile)."""

    # Extension: decode with the static, compiled step, as `lmtrace generate --compile` (each choice
    # alone, between the batch's steps; numbers within 5e-5 of the default path's).
    compile: bool = False


class CompletionRequest(Observing, Compiling, Sampling):
    # A string, or a list of token ids.
    prompt: Any = Field(...)
    # Return the logprob of each token and of this many alternatives (0-20).
    logprobs: Int | None = None
    # Answer with the prompt before the completion (and its tokens first in logprobs).
    echo: bool = False
    # Accepted only at OpenAI's neutral values.
    best_of: Int | None = None
    suffix: Text | None = None


# a message's content: a string, or content parts (only text ones: this server's models read
# text); null for an assistant turn that only calls tools. Checked in lmtrace.server.messages,
# which answers in OpenAI's words ("messages[0].content[0]: a text part needs \"text\"").
CONTENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"],
            },
        },
        {"type": "null"},
    ]
}


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Text
    # The arguments as JSON text, as OpenAI writes them.
    arguments: Text


class ToolCall(BaseModel):
    """A call an assistant turn made (in the history sent back)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, WithJsonSchema(CONTENT_SCHEMA)] = None
    name: Text | None = None
    # An assistant turn's tool calls; a tool turn's answer names the call it answers.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    # Accepted for compatibility, as OpenAI's client sends an answer's message back: a refusal,
    # annotations, and audio / function_call (only null).
    refusal: Text | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None
    # An assistant turn's reasoning (vLLM's and DeepSeek's names), handed to a chat template that
    # has a place for it (its source names `reasoning`: Qwen3's reasoning_content), else dropped.
    reasoning_content: Text | None = None
    reasoning: Text | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    # The arguments' JSON schema (default: an object with any properties).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Text


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call that one function."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


class Tools(BaseModel):
    """The tool fields of chat and /v1/traces (lmtrace.server.tools)."""

    # Functions the model may call; their schemas go into the prompt through the chat template.
    tools: list[Tool] | None = None
    # "auto" (the default with tools): the model decides; "none": no call; "required": one call
    # of one of the tools; {"type": "function", ...}: a call of that one. With "required" or a
    # named function the arguments are decoded under the function's parameter schema.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Accepted; one call at most is made per answer.
    parallel_tool_calls: bool | None = None


class ChatRequest(Observing, Compiling, Tools, Sampling):
    # The conversation, rendered with the model's chat template.
    messages: list[Message]
    # Extension (as vLLM's): extra variables for the model's chat template, such as
    # {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted for compatibility and ignored: nothing is stored, the prefix cache needs no key, and
    # safety_identifier is `user`'s newer name.
    store: bool | None = None
    metadata: dict[str, Text] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # Return each generated token's logprob (and `top_logprobs` alternatives, 0-20).
    logprobs: bool = False
    top_logprobs: Int | None = None
    # OpenAI's newer name for max_tokens.
    max_completion_tokens: Int | None = None


class TraceRequest(Observing, Compiling, Tools, Sampling):
    # One of: a prompt (string or token ids) or chat messages (with chat_template_kwargs, as chat's).
    prompt: Any = None
    messages: list[Message] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Alternatives recorded per step (0-100, as the CLI's --top-logprobs).
    top_logprobs: Int = 5
    # The prompt's own logprobs in the trace (`prompt_logprobs`, the CLI's --echo).
    echo: bool = False
    # The CLI's constraint keys (as on a batch line): a JSON schema, a regular expression, the
    # options of a choice, an EBNF grammar; and the whitespace a JSON schema allows.
    json_schema: dict[str, Any] | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_whitespace: Literal["compact", "any"] | None = None
