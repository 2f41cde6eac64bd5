"""Every option more than one command takes, declared once: the model (--model --device
--dtype ...), sampling (--temperature --top-k ... --top-logprobs), constraints (--json-schema
--regex --choice --grammar), inside a step (--lens --attention), output (--json). A command
whose default differs says so in its help."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from lmtrace import arguments
from lmtrace.errors import InvalidParameter
from lmtrace.params import SamplingParams


def _checked(check):
    """A click callback: the value checked as it is parsed, before any command imports torch."""

    def callback(ctx: click.Context, param: click.Parameter, value: str) -> str:
        check(value)
        return value

    return callback


def _remember(key: str):
    """A click callback keeping a flag in the context for code below the command (not an argument)."""

    def callback(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        ctx.meta[key] = value

    return callback


_MODEL_OPTIONS = [
    click.option(
        "--model",
        "model",
        default=None,
        metavar="PATH|ID",
        help="Model folder, .gguf file or hub id (local cache). Default: the bundled SmolLM2-135M-Instruct.",
    ),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or mps.",
                 callback=_checked(arguments.device)),  # fmt: skip
    click.option(
        "--dtype",
        default="auto",
        show_default=True,
        callback=_checked(arguments.dtype),
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, float16 or bfloat16.",
    ),
    click.option("--allow-pickle", is_flag=True, help="Allow .bin/.pt pickle weights (they can run code)."),
    click.option("--trust-remote-code", is_flag=True, help="Run the model repository's own Python code."),
    click.option("--verbose", is_flag=True, expose_value=False, callback=_remember("lmtrace.verbose"),
                 help="Also say where the model's files are (the converted copy's folder)."),  # fmt: skip
]


def model_options(f):
    """Adds --model --device --dtype --allow-pickle --trust-remote-code --verbose."""
    for option in reversed(_MODEL_OPTIONS):
        f = option(f)
    return f


def device_map_option(f):
    """Adds --device-map, for the commands that decode a model too large for one GPU."""
    return click.option(
        "--device-map",
        "device_map",
        type=click.Choice(["auto", "balanced", "balanced_low_0", "sequential"]),
        default=None,
        help="Spread the model's layers over the GPUs present (accelerate); instead of --device.",
    )(f)


def _choice(flag: str, choices: list[str], help: str) -> Callable:
    """A click option taking one of `choices`, the first the default."""
    return click.option(flag, type=click.Choice(choices), default=choices[0], show_default=True, help=help)


def weights_option(f):
    """Adds --weights: float (the default) or packed (a GGUF's own quantized weights, CPU)."""
    return _choice("--weights", ["float", "packed"],
                   "packed: run a .gguf's own quantized weights (Q4_0 … Q8_0, K-quants, IQ4) as 4- or 8-bit "
                   "codes (CPU; float32 activations through lmtrace's C kernel, bfloat16 without a C compiler) "
                   "instead of dequantizing them to --dtype.")(f)  # fmt: skip


def matmul_option(f):
    """Adds --matmul: default (torch's own kernel), onednn (float32 linear layers on weights packed
    once) or onednn-fused (and the small operations between them in C)."""
    return _choice("--matmul", ["default", "onednn", "onednn-fused"],
                   "onednn: float32 linear layers through oneDNN on weights packed once (CPU): a step of "
                   "several rows costs about one row's time; numbers differ from torch's kernel by float32 "
                   "rounding. onednn-fused: also RMSNorm, the rotary embedding and SiLU·mul of Llama layers "
                   "in C (compiled at first use with the machine's C compiler).")(f)  # fmt: skip


def batch_invariant_option(f):
    """Adds --batch-invariant: every number a row gets bitwise the same alone or in any batch."""
    return click.option("--batch-invariant", "batch_invariant", is_flag=True,
                        help="Batch-invariant operations (float32, CPU): every number a row gets is bitwise the "
                        "same alone or in any batch, prefilled or decoded, teacher-forced or not; within "
                        "5e-5 of the default path.")(f)  # fmt: skip


def _logit_bias(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[int, float]:
    """Each --logit-bias ID=BIAS as {token id: bias} (checked by SamplingParams)."""
    out: dict[int, float] = {}
    for value in values:
        token, sep, bias = value.partition("=")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise InvalidParameter(f"logit-bias must be ID=BIAS (a token id and a number), got {value!r}") from None
        if not sep:
            raise InvalidParameter(f"logit-bias must be ID=BIAS (a token id and a number), got {value!r}")
    return out


# name -> (flag, click settings); the defaults are SamplingParams' own
_SAMPLING: dict[str, tuple[str, dict[str, Any]]] = {
    "max_new_tokens": ("--max-new-tokens", {"type": int, "default": 64, "help": "Tokens to generate at most."}),
    "temperature": ("--temperature", {"type": float, "default": 1.0, "help": "0 means greedy."}),
    "top_k": ("--top-k", {"type": int, "default": 0, "help": "Keep the k most likely tokens (0: off)."}),
    "top_p": ("--top-p", {"type": float, "default": 1.0, "help": "Nucleus sampling mass (1: off)."}),
    "min_p": ("--min-p", {"type": float, "default": 0.0, "help": "Drop tokens below min_p × the top."}),
    "repetition_penalty": ("--repetition-penalty", {"type": float, "default": 1.0, "help": "1: off."}),
    "logit_bias": ("--logit-bias", {"multiple": True, "metavar": "ID=BIAS", "callback": _logit_bias,
                                    "help": "Add BIAS (-100 to 100) to token ID's logit before every other "
                                            "processor (repeatable; OpenAI's logit_bias)."}),
    "seed": ("--seed", {"type": int, "default": None, "help": "Seed for sampling (recorded in the trace)."}),
    "stop": ("--stop", {"multiple": True, "help": "Stop string (repeatable); the text is cut before it."}),
    "chat": ("--chat", {"is_flag": True, "help": "Wrap the prompt as a user message with the chat template."}),
    "top_logprobs": ("--top-logprobs", {"type": int, "default": 5, "help": "Alternatives recorded per step (0-100)."}),
}


def sampling_options(f: Callable | None = None, *, without: tuple[str, ...] = (), **changed: Any) -> Callable:
    """Adds the sampling options: `@sampling_options`, or `@sampling_options(temperature=0.0,
    without=("stop",), help={"seed": "..."})` for a command whose defaults differ (its help then
    names the difference) or that takes fewer options."""
    helps = changed.pop("help", {})

    def decorate(g: Callable) -> Callable:
        for name, (flag, settings) in reversed(_SAMPLING.items()):
            if name in without:
                continue
            s = dict(settings)
            if name in changed:
                s["default"] = changed[name]
                s["help"] = f"{s['help']} This command's default differs from generate's ({settings['default']})."
            s["help"] = helps.get(name, s["help"])
            if "default" in s and s["default"] is not None:
                s["show_default"] = True
            g = click.option(flag, **s)(g)
        return g

    return decorate(f) if f is not None else decorate


_CONSTRAINTS = [
    click.option("--json-schema", "json_schema", default=None, metavar="FILE",
                 help="Constrain the output to this JSON schema (a file); its values get confidences."),
    click.option("--regex", default=None, metavar="RE", help="Constrain the output to match this regular expression."),
    click.option("--choice", multiple=True, metavar="TEXT",
                 help="Constrain the output to one of these options (repeatable); each gets its exact probability."),
    click.option("--grammar", default=None, metavar="FILE",
                 help="Constrain the output to this EBNF grammar (a file; xgrammar's GBNF, rule `root`)."),
    click.option("--json-whitespace", type=click.Choice(["compact", "any"]), default="compact", show_default=True,
                 help="Whitespace a JSON schema allows: compact (none) or any (the lenient grammar)."),
]  # fmt: skip


def constraint_options(f):
    """Adds --json-schema --regex --choice --grammar --json-whitespace (xgrammar's constrained
    decoding, lmtrace.logits.grammar); `params_from` reads their files."""
    for option in reversed(_CONSTRAINTS):
        f = option(f)
    return f


def _read(option: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameter(f"{option}: cannot read {path!r} ({getattr(e, 'strerror', None) or e})") from e


def constraint_from(kw: dict) -> dict[str, Any]:
    """The constraint options as SamplingParams fields (the files read, the schema parsed)."""
    out: dict[str, Any] = {}
    if kw.get("json_schema") is not None:
        text = _read("json-schema", kw["json_schema"])
        try:
            out["json_schema"] = json.loads(text)
        except ValueError as e:
            raise InvalidParameter(f"json-schema: {kw['json_schema']!r} is not JSON ({e})") from e
    if kw.get("grammar") is not None:
        out["grammar"] = _read("grammar", kw["grammar"])
    if kw.get("regex") is not None:
        out["regex"] = kw["regex"]
    if kw.get("choice"):
        out["choice"] = tuple(kw["choice"])
    return {**out, "json_whitespace": kw.get("json_whitespace") or "compact"}


def params_from(kw: dict) -> SamplingParams:
    """SamplingParams from the sampling and constraint options (validated before the model loads)."""
    return SamplingParams(
        max_new_tokens=kw["max_new_tokens"],
        temperature=kw["temperature"],
        top_k=kw["top_k"],
        top_p=kw["top_p"],
        min_p=kw["min_p"],
        repetition_penalty=kw["repetition_penalty"],
        logit_bias=kw.get("logit_bias") or {},
        seed=kw["seed"],
        stop=tuple(kw.get("stop", ())),
        top_logprobs=kw["top_logprobs"],
        stop_on_eos=not kw.get("ignore_eos", False),
        **constraint_from(kw),
    )


JSON_INDENT = "lmtrace.json_indent"  # where --json-indent keeps its value (the click context's meta)


def _remember_indent(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= 8:
        raise InvalidParameter(f"json-indent must be 0-8 spaces, got {value}")
    ctx.meta[JSON_INDENT] = value
    return value


def json_indent() -> int | None:
    """The command's --json-indent (None: compact JSON, the default)."""
    ctx = click.get_current_context(silent=True)
    return None if ctx is None else ctx.meta.get(JSON_INDENT)


def json_option(what: str) -> Callable:
    """--json FILE: write `what` as compact JSON ('-' for stdout); --json-indent N indents it
    (read with `json_indent()`, so the command takes no parameter for it)."""

    def decorate(f: Callable) -> Callable:
        indent = click.option("--json-indent", type=int, default=None, metavar="N", expose_value=False,
                              is_eager=True, callback=_remember_indent,
                              help="Indent the --json output by N spaces (default: compact, one line).")  # fmt: skip
        json_path = click.option(
            "--json", "json_path", default=None, metavar="FILE", help=f"Write {what} as JSON ('-' for stdout)."
        )
        return json_path(indent(f))

    return decorate


def inside_options(f):
    """--lens, --attention and --attention-heads: what happens inside each step (lmtrace.inside.lens,
    lmtrace.inside.attention); the command gets `attention` True, False or "heads"."""

    @functools.wraps(f)
    def command(*args, **kw):
        if kw.pop("attention_heads"):
            kw["attention"] = "heads"
        return f(*args, **kw)

    attention = "Record each step's attention over the cache per layer (top positions, sinks), mean over heads."
    heads = "Like --attention, and also each head's own top positions, sink and recent mass, entropy."
    command = click.option("--attention-heads", is_flag=True, help=heads)(command)
    command = click.option("--attention", is_flag=True, help=attention)(command)
    return click.option("--lens", is_flag=True, help="Record every layer's prediction per step (logit lens).")(command)


def attribution_options(f):
    """--attribution and --against TOKEN|rank:N (lmtrace.inside.attribution); the command gets
    `attribution` (a flag) and `against` (None: the default, rank:2)."""

    def against(value: str | None) -> None:
        if value is not None:
            arguments.against(value)

    f = click.option("--against", default=None, metavar="TOKEN|rank:N", callback=_checked(against),
                     help="With --attribution: the other token, a token text, a token id or rank:N of the raw "
                     "distribution. Default rank:2 (the runner-up).")(f)  # fmt: skip
    return click.option("--attribution", is_flag=True, help="Split each step's logit difference (chosen token vs "
                        "--against) over the embedding, each layer's attention and MLP, and each head.")(f)  # fmt: skip




def logits_processor_option(f):
    """Adds --logits-processor NAME=module:function (repeatable): the command's processors by name,
    as vLLM v1's --logits-processors (lmtrace.logits.named); the command gets `logits_processor`."""
    return click.option(
        "--logits-processor",
        "logits_processor",
        multiple=True,
        metavar="NAME=module:function",
        help="Register a logits processor fn(token_ids, logits) -> logits under NAME (the module is imported): "
        'requests or lines name it in "logits_processors". Repeatable.',
    )(f)


def observer_option(f):
    """Adds --observer NAME=module:Class (repeatable): the command's observers by name
    (lmtrace.decode.named_observers); the command gets `observer`."""
    return click.option(
        "--observer",
        "observer",
        multiple=True,
        metavar="NAME=module:Class",
        help="Register an lmtrace.Observer class under NAME (the module is imported; each row gets a fresh "
        'instance): requests or lines name it in "observers". Repeatable.',
    )(f)


def draft_options(f):
    """--draft SPEC and --draft-tokens K: speculative decoding (lmtrace.model.draft), checked as
    they are parsed; the command gets `draft` (None: off) and `draft_tokens`."""

    def spec(value: str | None) -> None:
        if value is not None:
            arguments.draft_spec(value)

    def tokens(ctx: click.Context, param: click.Parameter, value: str | None) -> int | str | None:
        if value is None:
            return None
        return arguments.draft_tokens(int(value) if value.strip().lstrip("-").isdigit() else value.strip())

    f = click.option("--draft-tokens", "draft_tokens", default=None, metavar="K|auto", callback=tokens,
                     help="Tokens the draft proposes per block (1-16), or auto: chosen per block from the "
                     "measured costs and acceptance. Default 4.")(f)  # fmt: skip
    return click.option(
        "--draft", "draft", default=None, metavar="SPEC", callback=_checked(spec),
        help="Speculative decoding with a draft model: packed (the GGUF's own 4-bit weights), layers:N "
        "(the model's first N layers) or a model path with the same tokenizer. The numbers stay the model's.",
    )(f)  # fmt: skip


def draft_from(kw: dict) -> tuple[str | None, int]:
    """(draft, draft_tokens) from draft_options: --draft-tokens needs --draft."""
    draft, k = kw.pop("draft"), kw.pop("draft_tokens")
    if draft is None and k is not None:
        raise InvalidParameter(f"draft_tokens: only with --draft, got {k}")
    return draft, 4 if k is None else k


def check_compile_packed(compile_: bool, weights: str) -> None:
    """--compile with --weights packed: on lmtrace's kernel (a C compiler at hand) it compiles; on
    torch's bfloat16 kernel it is refused before the model loads (as lmtrace.decode.static.check)."""
    if not (compile_ and weights == "packed"):
        return
    from lmtrace.model.gguf.nibbles import kernel_available

    if not kernel_available():
        raise InvalidParameter(
            "compile: not with --weights packed on torch's int4 kernel (no C compiler for lmtrace's: its "
            "bfloat16 inputs turn the compiled graph's rounding into logprobs up to 0.1 apart from the packed "
            "path's); a packed draft compiles: --draft packed --compile"
        )


def check_compile_kernels(compile_: bool, matmul: str, draft: str | None) -> None:
    """--compile chooses its own kernels: not with --matmul, but for a draft of its own (--draft
    packed or a path), whose step is the one that compiles while the target keeps the kernel."""
    if matmul != "default" and compile_ and (draft is None or draft.startswith("layers:")):
        raise InvalidParameter(
            f"compile: --compile chooses its own kernels; not with --matmul {matmul} "
            "(but for a draft of its own, --draft packed: its step compiles, the target keeps the kernel)"
        )
