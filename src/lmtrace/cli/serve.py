"""`lmtrace serve`: the OpenAI-compatible server with traces and the viewer page, on uvicorn.
Loopback only unless another --host is asked for (with a warning when no --api-key is set)."""

from __future__ import annotations

import ipaddress
import json

import click

from lmtrace.cli.common import cli, load_draft, load_model
from lmtrace.cli.options import (
    batch_invariant_option,
    check_compile_kernels,
    check_compile_packed,
    draft_from,
    draft_options,
    logits_processor_option,
    matmul_option,
    model_options,
    observer_option,
    weights_option,
)
from lmtrace.errors import InvalidParameter


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listed(values: tuple[str, ...], name: str) -> list[str]:
    """A repeatable option's values, each also a comma-separated list or vLLM's JSON list
    ('["http://a.example"]')."""
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except ValueError as e:
                raise InvalidParameter(f"{name} must be values or a JSON list of strings, got {value!r} ({e})") from e
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise InvalidParameter(f"{name} must be values or a JSON list of strings, got {value!r}")
            out += items
        else:
            out += [v.strip() for v in value.split(",") if v.strip()]
    return out


LISTS = ("--allowed-origins", "--allowed-methods", "--allowed-headers")


def spread(args: list[str]) -> list[str]:
    """vLLM's spelling of a list option, several values after one flag (`--allowed-origins A B`),
    as click reads it: the flag before each value (serve takes no positional argument)."""
    out: list[str] = []
    flag = None
    for arg in args:
        if arg in LISTS:
            flag = arg
        elif arg.startswith("-"):
            flag = None
        elif flag is not None and out[-1] != flag:
            out.append(flag)
        out.append(arg)
    return out


class ServeCommand(click.Command):
    """`serve`, whose list options also take several values after one flag."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread(args))


def cors_from(kw: dict, api_key: str | None) -> dict:
    """create_app's CORS arguments from the options (taken out of `kw`): credentials go only with
    named origins; any origin without a key gets a warning."""
    origins = listed(kw.pop("allowed_origins"), "allowed_origins")
    allow_credentials = kw.pop("allow_credentials")
    if allow_credentials and "*" in origins:
        raise InvalidParameter("allow_credentials cannot be combined with --allowed-origins '*': name the origins")
    if "*" in origins and not api_key:
        click.echo("lmtrace: warning: --allowed-origins '*' without --api-key: any web page your browser opens "
                   "can use the model", err=True)  # fmt: skip
    out = {"allowed_origins": origins, "allow_credentials": allow_credentials}
    for name in ("allowed_methods", "allowed_headers"):
        out[name] = listed(kw.pop(name), name) or ["*"]
    return out


def check_options(
    host: str, port: int, max_concurrency: int, api_key: str | None, shutdown_timeout: float = 0.0
) -> None:
    """Refuses bad values before the model loads; warns when the server would be open to others."""
    if not 1 <= port <= 65535:
        raise InvalidParameter(f"port must be in [1, 65535], got {port}")
    if not 0 <= shutdown_timeout <= 3600:
        raise InvalidParameter(f"shutdown_timeout must be in [0, 3600] seconds, got {shutdown_timeout}")
    if max_concurrency < 1:
        raise InvalidParameter(f"max_concurrency must be >= 1, got {max_concurrency}")
    if api_key is not None and not api_key.strip():
        raise InvalidParameter("api_key must not be empty")
    if not is_loopback(host) and not api_key:
        click.echo(
            f"lmtrace: warning: serving on {host} without --api-key: anyone who can reach this port can use the model",
            err=True,
        )


def check_sizes(max_batch: int, prefix_cache_mb: int, max_body_mb: float, max_rows_per_request: int) -> None:
    """The server's sizes, checked before anything is loaded."""
    if max_batch < 1:
        raise InvalidParameter(f"max_batch must be >= 1, got {max_batch}")
    if prefix_cache_mb < 0:
        raise InvalidParameter(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
    if not 0 < max_body_mb <= 4096:
        raise InvalidParameter(f"max_body_mb must be in (0, 4096], got {max_body_mb}")
    if max_rows_per_request < 1:
        raise InvalidParameter(f"max_rows_per_request must be >= 1, got {max_rows_per_request}")


def check_compile(compile_: bool, matmul: str, batch_invariant: bool, draft: str | None, weights: str) -> None:
    """--compile chooses its own kernels (as lmtrace generate refuses it, a draft of its own aside),
    before the model loads."""
    check_compile_kernels(compile_, matmul, draft)
    check_compile_packed(compile_, weights)
    if compile_ and batch_invariant:
        raise InvalidParameter("compile: --compile chooses its own kernels; not with --batch-invariant")


@cli.command(cls=ServeCommand)
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on.")
@click.option(
    "--api-key",
    default=None,
    envvar="LMTRACE_API_KEY",
    help="Require 'Authorization: Bearer KEY' on every route but /health (or set LMTRACE_API_KEY).",
)
@click.option(
    "--max-concurrency",
    type=int,
    default=16,
    show_default=True,
    help="Requests admitted at once (generating together up to --max-batch rows, the others waiting); "
    "more get 429 with Retry-After.",
)
@click.option(
    "--max-batch",
    type=int,
    default=16,
    show_default=True,
    help="Rows (a prompt's choice each) decoded together; a request that arrives joins the running batch "
    "at the next step. 1: one request at a time.",
)
@click.option(
    "--prefix-cache-mb",
    type=int,
    default=1024,
    show_default=True,
    help="Bound of the prefix cache in MiB: a prompt whose beginning was computed before reuses that part's KV "
    "and numbers (least recently used out first). 0: off.",
)
@click.option("--served-model-name", default=None, help="Model id clients send (default: the model file's name).")
@click.option(
    "--allow-host",
    multiple=True,
    help="Another name clients may send as the Host header (a reverse proxy's), besides localhost, 127.0.0.1, [::1].",
)
@click.option(
    "--shutdown-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds requests in flight get to finish after SIGTERM or Ctrl-C; then they are cancelled.",
)
@click.option(
    "--max-body-mb",
    type=float,
    default=8.0,
    show_default=True,
    help="Largest request body in MiB; a larger one is answered 413 before it is read in full.",
)
@click.option(
    "--max-rows-per-request",
    type=int,
    default=1024,
    show_default=True,
    help="Rows (prompts times n) one request may ask for; more is a 400.",
)
@click.option("--allowed-origins", multiple=True, metavar="ORIGIN",
              help="Web pages' origins (http://localhost:3000, or * for any) allowed to call the server from a "
              "browser (CORS): one or more after the flag, repeatable, or a JSON list as vLLM's. Default: none.")
@click.option("--allowed-methods", multiple=True, metavar="METHOD",
              help="Methods such a page may use (one or more). Default: * (all).")
@click.option("--allowed-headers", multiple=True, metavar="HEADER",
              help="Request headers such a page may send (one or more). Default: * (all).")
@click.option("--allow-credentials", is_flag=True,
              help="Let such a page send the browser's credentials (cookies, HTTP auth); not with origin *.")
@click.option("--no-docs", is_flag=True, help="Do not serve the OpenAPI document (/openapi.json, /docs, /redoc).")
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="Let requests ask for the static, compiled decode step (`compile: true`), each choice decoded alone "
    "between the batch's steps; a one-off compile per sampling setting (tens of seconds on a CPU).",
)
@logits_processor_option
@observer_option
@draft_options
@weights_option
@matmul_option
@batch_invariant_option
def serve(
    model,
    device,
    dtype,
    allow_pickle,
    trust_remote_code,
    host,
    port,
    api_key,
    max_concurrency,
    max_batch,
    prefix_cache_mb,
    served_model_name,
    allow_host,
    shutdown_timeout,
    max_body_mb,
    max_rows_per_request,
    no_docs,
    weights,
    matmul,
    batch_invariant,
    **kw,
):
    """Serve the model: OpenAI's /v1/completions, /v1/chat/completions (tools too) and
    /v1/responses with exact logprobs, /v1/traces with the full trace, a viewer page at /, and
    the OpenAPI document at /openapi.json (browsable at /docs)."""
    from rich.console import Console

    check_options(host, port, max_concurrency, api_key, shutdown_timeout)  # before torch is imported
    cors = cors_from(kw, api_key)
    draft, draft_tokens = draft_from(kw)
    check_sizes(max_batch, prefix_cache_mb, max_body_mb, max_rows_per_request)
    check_compile(kw["compile_"], matmul, batch_invariant, draft, weights)
    from lmtrace.server import create_app
    from lmtrace.server.run import Runner

    status = Console(stderr=True)
    lm = load_model(status, model, device, dtype, allow_pickle, trust_remote_code, weights=weights, matmul=matmul,
                    batch_invariant=batch_invariant)  # fmt: skip
    chosen = load_draft(status, lm, draft)
    app = create_app(
        lm,
        name=served_model_name,
        api_key=api_key,
        max_concurrency=max_concurrency,
        allowed_hosts=allow_host,
        max_batch=max_batch,
        draft=chosen,
        draft_tokens=draft_tokens,
        prefix_cache_bytes=prefix_cache_mb << 20,
        docs=not no_docs,
        max_body_bytes=max(1, int(max_body_mb * (1 << 20))),
        max_rows=max_rows_per_request,
        logits_processors=kw["logits_processor"],
        observers=kw["observer"],
        compile=kw["compile_"],
        **cors,
    )
    name = app.state.lmtrace.name
    shown = f"[{host}]" if ":" in host else host
    status.print(f"serving [bold]{name}[/bold] at http://{shown}:{port}/ (viewer) and http://{shown}:{port}/v1")
    Runner(app, host, port, shutdown_timeout).run()
