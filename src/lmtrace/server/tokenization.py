"""vLLM's POST /tokenize and POST /detokenize, so clients count tokens with the server's own
tokenizer: {"prompt": ...} or {"messages": ...} -> {"count", "max_model_len", "tokens",
"token_strs"}; {"tokens": [...]} -> {"prompt": "..."}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from lmtrace.model.lm import LM
from lmtrace.server import messages
from lmtrace.server.errors import bad_request
from lmtrace.server.generation import ServerState
from lmtrace.server.length import context_size
from lmtrace.server.prepare import check_model
from lmtrace.server.schemas import Int, Message, Text
from lmtrace.server.threaded import ThreadedRoute

router = APIRouter(route_class=ThreadedRoute)  # bodies parsed, answers encoded off the loop


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: `prompt` (vLLM's TokenizeCompletionRequest) or `messages` through the
    chat template (its TokenizeChatRequest), with vLLM's defaults for each."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    prompt: Text | None = None
    messages: list[Message] | None = None
    # Add the tokenizer's special tokens (BOS); vLLM's default: true for a prompt, false for
    # messages (the template writes them).
    add_special_tokens: bool | None = None
    # With messages: end with the assistant's turn opening (default), or continue the last
    # message (the two exclude each other).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # With messages, as vLLM's: tool definitions handed to the chat template (templates that know
    # tools write them into the prompt), and extra variables for the template (such as
    # enable_thinking). A template sent with the request is not run: the model's own is.
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Also answer each token as the tokenizer's own string.
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    tokens: list[Int]


def _chat_ids(front: LM, body: TokenizeRequest) -> list[int]:
    tok = front.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("messages: this model has no chat template; send prompt instead", "messages")
    if not body.messages:
        raise bad_request("messages must hold at least one message", "messages")
    if body.add_generation_prompt and body.continue_final_message:
        raise bad_request(
            "continue_final_message: set at most one of add_generation_prompt and continue_final_message",
            "continue_final_message",
        )
    turns = messages.turns(body.messages, native=True, reasoning=messages.knows_reasoning(tok.chat_template))
    extra = messages.template_kwargs(body.chat_template_kwargs)
    try:
        text = tok.apply_chat_template(
            turns,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=False,
            **extra,
        )
    except Exception as e:  # the model's template refused these messages, tools or variables
        raise bad_request(f"messages: the chat template failed: {' '.join(str(e).split())[:300]}", "messages") from e
    special = bool(body.add_special_tokens)  # vLLM's default for messages: false
    return list(tok(text, add_special_tokens=special)["input_ids"])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", "prompt")
    return await state.prepare(_tokenize, body)


def _tokenize(front: LM, body: TokenizeRequest) -> dict[str, Any]:
    if body.messages is not None:
        ids = _chat_ids(front, body)
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(front.tokenizer(body.prompt, add_special_tokens=special)["input_ids"])
    strs = front.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": context_size(front), "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state: ServerState = request.app.state.lmtrace
    check_model(body, state.name)
    vocab = state.lm.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens must be in [0, {vocab - 1}], got {bad[0]}", "tokens")
    return {"prompt": await state.prepare(lambda front: front.tokenizer.decode(body.tokens))}
