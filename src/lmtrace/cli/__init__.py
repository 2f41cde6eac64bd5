"""The command line: parse, call the library, render. Errors become one line and an exit code
(0 done, 2 bad input, 1 a failure while running). Each command lives in its own module."""

from __future__ import annotations

import os
import sys

import click

# importing a command module registers its command on `cli`
from lmtrace.cli import audit, batch, branch, cache, common, compare, export, generate, render, score, serve, verify  # noqa: E402, F401, I001
from lmtrace.cli import intervene as _intervene  # noqa: E402, F401
from lmtrace.cli import kld as _kld  # noqa: E402, F401
from lmtrace.cli import kvlab as _kvlab  # noqa: E402, F401
from lmtrace.cli import rollouts as _rollouts  # noqa: E402, F401
from lmtrace.cli import sample as _sample  # noqa: E402, F401
from lmtrace.cli import stability as _stability  # noqa: E402, F401
from lmtrace.cli import steer_vector as _steer_vector  # noqa: E402, F401
from lmtrace.cli.common import cli
from lmtrace.errors import LmtraceError


def main(argv: list[str] | None = None) -> int:
    common.begin()
    try:
        # without standalone mode click returns a command's Exit code instead of raising it
        code = cli.main(args=argv, prog_name="lmtrace", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("lmtrace: aborted", err=True)
        return 130
    except click.ClickException as e:
        click.echo(f"lmtrace: error: {' '.join(e.format_message().split())}", err=True)
        return 2
    except LmtraceError as e:
        click.echo(f"lmtrace: error: {e}", err=True)
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("lmtrace: interrupted", err=True)
        return 130
    except Exception as e:  # a failure while running: one line, the traceback only on request
        if os.environ.get("LMTRACE_DEBUG"):
            raise
        click.echo(f"lmtrace: error: {type(e).__name__}: {' '.join(str(e).split())}", err=True)
        return 1
    finally:
        common.finish()


def entry() -> None:
    sys.exit(main())
